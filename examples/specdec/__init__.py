"""Reference speculative-decoding (EAGLE-3 style) trainer: one thread per device, one process per node.

Run it as ``python examples/specdec/train.py --preset cpu-tiny``; see docs/trainer.md.
"""
