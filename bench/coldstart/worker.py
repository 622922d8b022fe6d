"""A GPU inference worker that times its own cold start.

    T0=<unix time of the spawn> python3 worker.py MODEL WEIGHTS.safetensors SOCK

Phases, in seconds since T0 (set by whoever spawns it, just before the spawn): spawn (Python is
running this file), import_torch, cuda_ctx, import_model_lib (torchvision or transformers),
model_build (on the meta device: no memory, no random init), load_weights (safetensors file into
host memory), to_gpu (device memory allocated and filled), first_infer.

Then it serves a path Unix socket, one request per connection (connect, send one line, read one
line, the worker closes), so that it holds no connection when it is snapshotted:

    infer    {"digest": sha256 of the output tensor's bytes, "latency_ms": forward pass time}
    phases   {"marks": {phase: seconds since T0}, "versions": {...}, "model": MODEL, "build": how}
    ping     "pong"
"""

from __future__ import annotations

import os
import sys
import time

T0 = float(os.environ.get("T0") or time.time())
MARKS: dict[str, float] = {"spawn": time.time() - T0}


def mark(phase: str) -> None:
    MARKS[phase] = time.time() - T0


import hashlib  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import build, check, example_input, forward, import_libraries, named_tensors  # noqa: E402

import torch  # noqa: E402

mark("import_torch")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()),
    }
    for dist in ("torchvision", "transformers", "safetensors", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


class Worker:
    def __init__(self, name: str, weights: Path) -> None:
        self.name = name
        self.build = "meta"
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.cuda.init()
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
        mark("cuda_ctx")

        import_libraries(name)
        mark("import_model_lib")

        self.input = example_input(name).to("cuda")
        try:
            self.model = self.load(weights, "meta")
            self.run()
        except Exception as e:
            # A model that keeps a tensor outside its parameters and buffers cannot be built on the
            # meta device; build it for real on the GPU instead, and say so in the results.
            print(
                f"worker: building on the meta device failed ({type(e).__name__}: {e}); building on cuda",
                file=sys.stderr,
                flush=True,
            )
            self.build = f"cuda (meta failed: {type(e).__name__}: {e})"[:300]
            self.__dict__.pop("model", None)  # free the half-made model before building another
            torch.cuda.empty_cache()
            self.model = self.load(weights, "cuda")
            self.run()
        mark("first_infer")

    def load(self, weights: Path, build_on: str) -> torch.nn.Module:
        """Build the model on `build_on` ("meta": nothing allocated nor initialised), fill it from
        the safetensors file, leave it on the GPU in eval mode."""
        with torch.device(build_on):
            model = build(self.name)
        mark("model_build")

        from safetensors import safe_open
        from safetensors.torch import load_file

        state = load_file(str(weights), device="cpu")
        with safe_open(str(weights), framework="pt") as f:
            meta = f.metadata() or {}
        aliases: dict[str, str] = json.loads(meta.get("aliases", "{}"))
        if meta.get("model") not in (None, self.name):
            raise SystemExit(f"{weights} holds weights of {meta.get('model')}, not {self.name}")
        mark("load_weights")

        if build_on == "meta":
            model = model.to_empty(device="cuda")
            tie = getattr(model, "tie_weights", None)
            if callable(tie):
                tie()  # to_empty may have given tied weights separate storage
        missing = []
        used = set()
        with torch.no_grad():
            for key, t in named_tensors(model):
                src = aliases.get(key, key)
                if src not in state:
                    missing.append(key)
                    continue
                t.copy_(state[src])
                used.add(src)
        unexpected = sorted(set(state) - used)
        if missing or unexpected:
            raise SystemExit(
                f"{weights} does not fit {self.name}: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        del state
        torch.cuda.synchronize()
        mark("to_gpu")
        return model.eval()

    def run(self) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        with torch.no_grad():
            out = forward(self.name, self.model, self.input)
        torch.cuda.synchronize()
        return out, (time.perf_counter() - start) * 1000

    def handle(self, words: list[str]) -> str:
        cmd = words[0] if words else ""
        if cmd == "infer":
            out, ms = self.run()
            digest = hashlib.sha256(out.float().cpu().contiguous().numpy().tobytes()).hexdigest()
            return json.dumps({"digest": digest, "latency_ms": round(ms, 3)})
        if cmd == "phases":
            return json.dumps(
                {"model": self.name, "build": self.build, "marks": MARKS, "versions": versions()}
            )
        if cmd == "ping":
            return "pong"
        return json.dumps({"error": f"unknown command {cmd!r}"})


def serve(worker: Worker, path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(30)
            try:
                data = b""
                while b"\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                words = data.decode(errors="replace").split()
                try:
                    reply = worker.handle(words)
                except Exception as e:  # a failed request must not end the worker
                    reply = json.dumps({"error": f"{type(e).__name__}: {e}"})
                conn.sendall(reply.encode() + b"\n")
            except OSError:
                pass


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit("usage: T0=<unix time> worker.py MODEL WEIGHTS.safetensors SOCK")
    name, weights, sock = check(argv[0]), Path(argv[1]), argv[2]
    if not weights.is_file():
        raise SystemExit(f"{weights}: no such file (make it with make_weights.py)")
    worker = Worker(name, weights)
    print(json.dumps({"model": name, "marks": MARKS}), flush=True)
    serve(worker, sock)


if __name__ == "__main__":
    main(sys.argv[1:])
