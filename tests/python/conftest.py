# Makes the in-tree package importable without installing it. The library is found through
# TENSORFERRY_LIBRARY (tests/run_all.sh sets it) or the checkout's build*/src directories.
import os
import sys

_BINDINGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings",
                         "python")
if os.path.isdir(_BINDINGS) and os.path.abspath(_BINDINGS) not in sys.path:
    sys.path.insert(0, os.path.abspath(_BINDINGS))
