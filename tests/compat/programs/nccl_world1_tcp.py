"""torch.distributed with the NCCL backend, world size 1, a TCP store: the way serving engines
initialise it. Collectives must work after the restore."""

from __future__ import annotations

from compat_common import nccl_world1, serve

REQUIRES = ("torch",)
EXPECT = "identical"

serve(nccl_world1("tcp://127.0.0.1:29511", seed=7))
