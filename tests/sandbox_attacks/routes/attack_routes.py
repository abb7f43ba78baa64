"""What the sandbox attacks reach for past the static scan: ``os``, ``threading``, ``ctypes`` and ``resource``.

The attack suite (tests/test_grading_sandbox_attacks.py) tests the sandbox's walls, which must hold
whatever the scan misses. Its answer cells import this module (``from attack_routes import os``),
found through PYTHONPATH, which the suite points here while it grades: the scan does not know the
module, so the attack really runs, as code the scan never understood would.
"""

import ctypes
import os
import resource
import threading

__all__ = ["ctypes", "os", "resource", "threading"]
