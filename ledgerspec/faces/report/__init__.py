"""The ledger report: the data it shows (:mod:`.data`), the stacked bar (:mod:`.bar`), and its two renderings
(:mod:`.terminal`, :mod:`.html`)."""
