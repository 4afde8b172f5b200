"""Test and benchmark support shared by ``tests/`` and ``bench/``: the hazard scenarios and the soak harness.

Not part of the installed package (only ``torch_threadsafe_compile`` ships); imported from the source tree.
"""
