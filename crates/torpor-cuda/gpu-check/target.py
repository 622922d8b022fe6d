# A CUDA process to checkpoint: holds ~3 GiB on the GPU, computes while ./busy exists, exits on
# ./stop after checking that its data survived.
import os, time, torch
torch.backends.cuda.matmul.allow_tf32 = False
a = torch.randn(16384, 16384, device="cuda")
keep = torch.arange(1 << 29, device="cuda", dtype=torch.float32)
before = float(a.sum()), float(keep[-1])
print("ready", os.getpid(), flush=True)
n = 0
while not os.path.exists("stop"):
    if os.path.exists("busy"):
        b = a @ a
        torch.cuda.synchronize()
        n += 1
    else:
        time.sleep(0.02)
after = float(a.sum()), float(keep[-1])
print("matmuls", n, "before", before, "after", after, "identical", before == after, flush=True)
