"""torpor.graphed on a GPU (torpor.graphs; docs/sandboxes.md, "CUDA graphs"): replays equal the
eager model bit for bit, on many request threads and streams at once without one request's
inputs overwriting another's; other shapes run eager; a forward that cannot be captured is one
error and leaves the device usable; a capture goes through while a sandbox's other threads
allocate, synchronise and give their pools back. Each case runs in a fresh interpreter (CUDA
is not initialised in pytest's). Skipped where torch or a CUDA device is missing."""

from __future__ import annotations

import importlib.util

import pytest
from sdkd import run_ok

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")

MODEL = (
    "import threading, torch, torpor\n"
    "from torpor import gpu\n"
    "torch.manual_seed(0)\n"
    "nn = torch.nn\n"
    "model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),\n"
    "    nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),\n"
    "    nn.Linear(32, 10)).cuda().eval()\n"
)


def test_replays_equal_the_eager_model_on_many_streams_at_once(cuda: None) -> None:
    """Four request threads, each on its own stream (as a sandbox runs them), share three
    instances; every answer is the eager model's for that request's input, bit for bit, and
    what a call returned stays as it was after later replays (a copy, not the graph's output)."""
    code = MODEL + (
        "g = torpor.graphed(model, torch.zeros(2, 3, 32, 32, device='cuda'), instances=3)\n"
        "gen = torch.Generator(device='cuda').manual_seed(1)\n"
        "xs = [torch.randn(2, 3, 32, 32, device='cuda', generator=gen) for _ in range(8)]\n"
        "with torch.inference_mode():\n"
        "    want = [model(x).clone() for x in xs]\n"
        "torch.cuda.synchronize()\n"
        "bad = []\n"
        "def request_loop(k):\n"
        "    for it in range(50):\n"
        "        i = (k * 3 + it) % 8\n"
        "        with gpu.request_stream('torch'):\n"
        "            y = g(xs[i])\n"
        "            if not torch.equal(y, want[i]):\n"
        "                bad.append((k, it, float((y - want[i]).abs().max())))\n"
        "ts = [threading.Thread(target=request_loop, args=(k,)) for k in range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "assert not bad, bad[:5]\n"
        "kept = g(xs[0])\n"
        "for x in xs[1:]:\n"
        "    g(x)\n"
        "assert torch.equal(kept, want[0]), 'a later replay changed an earlier answer'\n"
        "assert not kept.is_inference(), 'outputs are plain tensors'\n"
        "s = g.stats()\n"
        "assert s == {'replays': 4 * 50 + 8, 'eager': 0, 'shapes': 1}, s\n"
        "other = torch.randn(3, 3, 32, 32, device='cuda')\n"
        "with torch.inference_mode():\n"
        "    assert torch.equal(g(other), model(other))\n"
        "assert g.stats()['eager'] == 1, g.stats()\n"
        "assert g.capture(other) is True and g.stats()['shapes'] == 2\n"
        "with torch.inference_mode():\n"
        "    assert torch.equal(g(other), model(other))\n"
        "assert g.stats()['replays'] == 4 * 50 + 9, g.stats()\n"
        "print('ok', s)\n"
    )
    run_ok(code)


def test_a_forward_that_cannot_be_captured_is_one_error_and_the_device_stays_usable(cuda: None) -> None:
    code = MODEL + (
        "from torpor.errors import DefinitionError\n"
        "def syncs(x):\n"
        "    return x * x.sum().item()\n"
        "try:\n"
        "    torpor.graphed(syncs, torch.ones(4, device='cuda'))\n"
        "    raise SystemExit('captured a forward that synchronises with the host')\n"
        "except DefinitionError as e:\n"
        "    msg = str(e)\n"
        "assert '\\n' not in msg and 'cannot capture syncs' in msg and 'no .item()' in msg, msg\n"
        "assert torch.ones(4, device='cuda').sum().item() == 4\n"
        "g = torpor.graphed(model, torch.zeros(1, 3, 32, 32, device='cuda'), instances=1)\n"
        "x = torch.randn(1, 3, 32, 32, device='cuda')\n"
        "with torch.inference_mode():\n"
        "    assert torch.equal(g(x), model(x))\n"
        "print('ok', msg)\n"
    )
    run_ok(code)


def test_a_capture_goes_through_while_other_threads_run_requests_and_give_pools_back(cuda: None) -> None:
    """As when a function loads into a sandbox whose other functions serve: their request threads
    allocate through their pools and synchronise their streams while the new function captures
    its graphs, and another function's idle pool is given back meanwhile. That empty must wait
    for a moment when no request is in a pool: in session 36 this case aborted the process
    (PyTorch's `captures_underway.empty()` assert in ~MemPool) even without any capture; it is
    refused (DEFERRED) while a request runs and done once none does (torpor.mempool.GATE)."""
    code = MODEL + (
        "import time\n"
        "from torpor import mempool\n"
        "busy, idle = mempool.FunctionPool('busy', 'cuda'), mempool.FunctionPool('idle', 'cuda')\n"
        "stop = threading.Event()\n"
        "done = {'busy': 0, 'released': 0, 'deferred': 0}\n"
        "w = torch.randn(512, 512, device='cuda')\n"
        "def serve():\n"
        "    while not stop.is_set():\n"
        "        with gpu.request_stream('torch'), busy.request():\n"
        "            n = 64 + 64 * (done['busy'] % 7)\n"
        "            (torch.ones(n, 512, device='cuda') @ w).sum().item()\n"
        "        done['busy'] += 1\n"
        "        time.sleep(0.002)\n"
        "def give_back():\n"
        "    while not stop.is_set():\n"
        "        with gpu.request_stream('torch'), idle.request():\n"
        "            torch.empty(8 << 20, dtype=torch.uint8, device='cuda').fill_(1)\n"
        "        got = idle.release()\n"
        "        done['deferred' if got == mempool.DEFERRED else 'released'] += 1\n"
        "ts = [threading.Thread(target=serve), threading.Thread(target=give_back)]\n"
        "[t.start() for t in ts]\n"
        "time.sleep(0.5)\n"
        "g = torpor.graphed(model, torch.zeros(4, 3, 32, 32, device='cuda'), instances=4)\n"
        "time.sleep(0.5)\n"
        "stop.set(); [t.join() for t in ts]\n"
        "x = torch.randn(4, 3, 32, 32, device='cuda')\n"
        "with torch.inference_mode():\n"
        "    assert torch.equal(g(x), model(x))\n"
        "assert done['busy'] > 0 and done['released'] > 0, done\n"
        "def idle_request():\n"
        "    with gpu.request_stream('torch'), idle.request():\n"
        "        torch.empty(8 << 20, dtype=torch.uint8, device='cuda').fill_(1)\n"
        "t = threading.Thread(target=idle_request); t.start(); t.join()\n"
        "with gpu.request_stream('torch'), busy.request():\n"
        "    assert idle.release() == mempool.DEFERRED, 'emptied while a request was in a pool'\n"
        "assert idle.release() >= 8 << 20, 'nothing in a pool now: the release runs'\n"
        "assert busy.release() > 0\n"
        "with gpu.request_stream('torch'), busy.request():\n"
        "    try:\n"
        "        g.capture(torch.zeros(2, 3, 32, 32, device='cuda'))\n"
        "        raise SystemExit('captured inside a request pool')\n"
        "    except torpor.DefinitionError as e:\n"
        "        assert 'capture in setup()' in str(e), e\n"
        "print('ok', done)\n"
    )
    run_ok(code)
