"""TODO"""

from fabricnode import native as _native

# The compiled data plane, when built from the current sources (fabricnode/native.py).
_native.activate(__path__)
