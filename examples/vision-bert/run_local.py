"""Runs examples/vision-bert's three stages one after the other in this process, without torpord
(each stage's directory bound with torpor.use_dir, so torpor.load finds its files, and the store
held in this process), and prints the workflow's answer as JSON: what the deployed workflow must
answer (tests/daemon/test_daemon_sandbox_gpu.py compares them).

    python3 examples/vision-bert/run_local.py '{"seed": 3}'
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The SDK: installed, or the repository's python/.
if importlib.util.find_spec("torpor") is None and (HERE.parents[1] / "python" / "torpor").is_dir():
    sys.path.insert(0, str(HERE.parents[1] / "python"))

import torpor  # noqa: E402


def run(request: dict[str, Any]) -> Any:
    value: Any = request
    for name in ("detect", "classify", "describe"):
        torpor.use_dir(HERE / name)
        spec = importlib.util.spec_from_file_location(f"vision_bert_{name}", HERE / name / "model.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cls = next(v for v in vars(module).values() if getattr(v, "__torpor_function__", False))
        f = cls()
        f.setup()
        value = f(value)
    return value


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1] if len(sys.argv) > 1 else '{"seed": 3}'))))
