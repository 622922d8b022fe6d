"""Writes the weights of examples/vision-bert's three stages, randomly initialised with fixed seeds
(nothing is downloaded), and stage 3's WordPiece vocabulary. Run it once before deploying (needs
torch, torchvision and transformers; 0.6 GB written, so not in the repository):

    python3 examples/vision-bert/make_weights.py

- detect/weights.safetensors:   Faster R-CNN, MobileNetV3-Large 320 FPN (torchvision), seed 1
- classify/weights.safetensors: ResNet-50 (torchvision), seed 2
- describe/vocab.txt:           BERT's special tokens, then every word and punctuation mark of
                                ImageNet's and COCO's class names (as torchvision lists them) and of
                                the captions, lower-cased
- describe/weights.safetensors: BERT-base with that vocabulary and a 4-topic head, seed 3

The models are built on the CPU, so the files are the same on every machine.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import unicodedata
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
CAPTION_WORDS = "a photo of and nothing"


def stage(name: str) -> ModuleType:
    """`name`/model.py, imported by path (each stage's directory is a function of its own). The
    stages import the SDK: from the repository's python/ when it is not installed."""
    if importlib.util.find_spec("torpor") is None and (HERE.parents[1] / "python" / "torpor").is_dir():
        sys.path.insert(0, str(HERE.parents[1] / "python"))
    spec = importlib.util.spec_from_file_location(f"vision_bert_{name}", HERE / name / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def words(text: str) -> list[str]:
    """What BERT's basic tokenizer makes of `text` when it lower-cases: accents stripped, split
    on white space and around each punctuation mark."""
    text = "".join(c for c in unicodedata.normalize("NFD", text.lower()) if unicodedata.category(c) != "Mn")
    return re.findall(r"\w+|[^\w\s]", text)


def vocabulary() -> list[str]:
    from torchvision.models import ResNet50_Weights
    from torchvision.models.detection import FasterRCNN_MobileNet_V3_Large_320_FPN_Weights

    names = [*ResNet50_Weights.IMAGENET1K_V2.meta["categories"], *FasterRCNN_MobileNet_V3_Large_320_FPN_Weights.COCO_V1.meta["categories"]]
    found = {w for n in names for w in words(n)} | set(words(CAPTION_WORDS))
    return [*SPECIAL, *sorted(found - set(SPECIAL))]


def save(model: object, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    assert isinstance(model, torch.nn.Module)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp))
    # Readable by the workers, which torpord runs as other users (safetensors writes 0600).
    tmp.chmod(0o644)
    tmp.rename(path)
    print(f"{path.relative_to(HERE)}: {len(state)} tensors, {path.stat().st_size / 1e6:.0f} MB")


def main() -> int:
    import torch

    for seed, name in ((1, "detect"), (2, "classify")):
        torch.manual_seed(seed)
        save(stage(name).build("cpu"), HERE / name / "weights.safetensors")
    vocab = vocabulary()
    (HERE / "describe" / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (HERE / "describe" / "vocab.txt").chmod(0o644)
    print(f"describe/vocab.txt: {len(vocab)} tokens")
    torch.manual_seed(3)
    save(stage("describe").build(len(vocab), "cpu"), HERE / "describe" / "weights.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
