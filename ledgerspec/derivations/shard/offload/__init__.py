"""CPU offload per rank: which side of the PCIe bus each storage is on, and what moves between them.

- :mod:`.sides`: the simulation's two sides (a tracker that keeps the host's bytes apart, each phase's split);
- :mod:`.fsdp`: FSDP's CPU offload (FSDP2 ``CPUOffloadPolicy``, FSDP1 ``CPUOffload``), simulated and calculated;
- :mod:`.zero`: DeepSpeed ZeRO's offload (``offload_optimizer``, ``offload_param``) in the simulation.
"""
