"""Test set-up: every test sees 8 simulated CPU devices.

The flag must be set before JAX initialises its backends, so it lives here,
at import time of the first module pytest loads.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
