"""torch.distributed with the NCCL backend, world size 1, a file store. Collectives must work
after the restore."""

from __future__ import annotations

import os

from compat_common import nccl_world1, serve

REQUIRES = ("torch",)
EXPECT = "identical"

STORE = "/tmp/torpor-compat-nccl-store"  # the tree's own /tmp
if os.path.exists(STORE):
    os.unlink(STORE)
serve(nccl_world1(f"file://{STORE}", seed=8))
