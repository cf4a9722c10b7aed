"""The stack: a document's model config, the model on the meta device, the exact adapters, and the storage
rules of what they hold (bitsandbytes 4-bit/8-bit weights, optimizer state).

- :mod:`.build`: config (local or Hub), meta-device model, ``peft.LoraConfig``, adapter injection;
- :mod:`.census`: every tensor of the configuration, read off the meta model;
- :mod:`.bnb_storage`: bytes of bitsandbytes-quantized weights;
- :mod:`.optimizer_state`: bytes of an optimizer's state;
- :mod:`.quiet`: importing bitsandbytes/PEFT without noise;
- :mod:`.sources`: which release of a library function our code was written against (its source's digest).
"""

from ledgerspec.derivations.stack.build import ModelSource, build_meta_model, inject_adapters, load_config
from ledgerspec.derivations.stack.census import Census, census

__all__ = ["Census", "ModelSource", "build_meta_model", "census", "inject_adapters", "load_config"]
