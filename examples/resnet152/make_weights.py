"""Write weights.safetensors, the resnet152 example's weights: ResNet-152 randomly initialised with a fixed
seed (0), every parameter and buffer stored, tied weights listed as aliases in the metadata.
Needs torch and torchvision; uses the GPU if there is one. Run it once, before deploying:

    python3 make_weights.py

It reuses the cold-start benchmark's model definition and writer (bench/coldstart/models.py and
make_weights.py), so the file is the same one that benchmark loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLDSTART = HERE.parent.parent / "bench" / "coldstart"


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(COLDSTART))
    import make_weights  # bench/coldstart/make_weights.py

    return make_weights.main(["resnet152", str(HERE / "weights.safetensors"), *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
