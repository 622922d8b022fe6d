"""Stage 3 of examples/vision-bert: a BERT-base text classifier (transformers'
BertForSequenceClassification: 12 layers, 768 wide, 12 heads) names the scene's topic from a
caption made of stage 2's labels.

Request: stage 2's value, {"labels": [...], "confidence": [...], ...}.
Value:   {"caption": str, "topic": str, "scores": {topic: p}, "tokens": int, "labels", "boxes",
          "objects", "request"}

The tokenizer is BERT's (the `tokenizers` library's WordPiece model, BERT's normaliser and
pre-tokenizer, `[CLS] … [SEP]`) over vocab.txt, the words of ImageNet's and COCO's class names and
the caption's own (../make_weights.py writes it with the weights: nothing is downloaded). Weights random with a fixed seed, so the topic is an untrained head's,
deterministically.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

import torpor

TOPICS = ("nature", "city", "animals", "objects")
MAX_TOKENS = 64


def config(vocab_size: int) -> transformers.BertConfig:
    """BERT-base with this vocabulary, a classification head over TOPICS."""
    return transformers.BertConfig(vocab_size=vocab_size, num_labels=len(TOPICS))


def build(vocab_size: int, device: str = "cuda") -> torch.nn.Module:
    with torch.device(device):
        return transformers.BertForSequenceClassification(config(vocab_size))


def load_into(model: torch.nn.Module, path: str) -> None:
    from safetensors.torch import load_file

    state = load_file(path, device="cuda")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} does not fit {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}; run make_weights.py")


def tokenizer(vocab_path: str) -> Tokenizer:
    """BERT's tokenization (lower-cased, accents stripped, split on punctuation, WordPiece) over
    the vocabulary file, one token a line."""
    with open(vocab_path, encoding="utf-8") as f:
        vocab = {w: i for i, w in enumerate(f.read().splitlines())}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tok.enable_truncation(MAX_TOKENS)
    return tok


def caption(labels: list[str]) -> str:
    names = [label.lower() for label in labels]
    if len(names) < 2:
        return f"a photo of {''.join(names) or 'nothing'}"
    return f"a photo of {', '.join(names[:-1])} and {names[-1]}"


@torpor.function
class Describe:
    def setup(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("vision-bert needs a CUDA GPU (torpor.toml: gpus = 1)")
        self.tokenizer = tokenizer(str(torpor.load("vocab")))
        model = build(self.tokenizer.get_vocab_size())
        load_into(model, str(torpor.load("weights")))
        self.model = model.eval()

    def describe(self, text: str) -> tuple[dict[str, float], int]:
        ids = torch.tensor([self.tokenizer.encode(text).ids], device="cuda")
        with torch.inference_mode():
            p = torch.softmax(self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0], dim=-1)
        return {t: round(v, 6) for t, v in zip(TOPICS, p.tolist())}, int(ids.shape[1])

    def __call__(self, request: Any) -> dict[str, Any]:
        if isinstance(request, dict) and request.get("warmup"):
            return {"scores": self.describe(caption(["tabby", "tiger cat"]))[0]}
        if not isinstance(request, dict) or not isinstance(request.get("labels"), list):
            raise ValueError('the request must be stage 2\'s value, {"labels": [...], ...}')
        text = caption([str(label) for label in request["labels"]])
        scores, tokens = self.describe(text)
        return {
            "caption": text,
            "topic": max(scores, key=lambda t: scores[t]),
            "scores": scores,
            "tokens": tokens,
            "labels": request["labels"],
            "boxes": request.get("boxes", []),
            "objects": request.get("objects", []),
            "request": request.get("request"),
        }
