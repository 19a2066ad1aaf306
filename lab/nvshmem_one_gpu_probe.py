"""Lab (issue 58): can torch's NVSHMEM backend run several PEs on one GPU (NVSHMEM's "multiple processes per GPU")?
If it can, the put-with-signal exchanges run between processes sharing the one lent GPU.

Limited MPG (no MPS server) refuses torch's team creation in the rendezvous ("Called NVSHMEM API not supported
with limited MPG"); variant ``mps`` runs under an MPS server that the caller starts (each PE at 100/PEs percent
of the SMs, as NVSHMEM's full MPG support asks). For each environment variant, starts ``--pes`` processes on cuda:0 (gloo group over TCP), sets the NVSHMEM
backend, allocates and rendezvouses a symmetric buffer, then: (1) a Triton kernel that puts this PE's block into
every peer's buffer with put-with-signal and waits (bounded, on its own signal words) for the peers' blocks;
(2) torch's ``symm_mem.all_to_all_vdev``. Prints one line per PE and step; every process ends within
``--timeout`` seconds.

    python lab/nvshmem_one_gpu_probe.py --pes 2
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

VARIANTS = {
    "default": {},
    "no-vmm": {"NVSHMEM_DISABLE_CUDA_VMM": "1"},
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD.group_name
    symm.set_backend("NVSHMEM")
    n = 4096
    buf = symm.empty(world * n, dtype=torch.float32, device="cuda:0")
    sig = symm.empty(world, dtype=torch.int64, device="cuda:0")
    t0 = time.time()
    h = symm.rendezvous(buf, group)
    symm.rendezvous(sig, group)
    print(f"pe {rank}: rendezvous ok ({time.time() - t0:.1f}s) rank {h.rank} world {h.world_size}", flush=True)
    buf.fill_(-1.0)
    sig.zero_()
    src = torch.full((n,), float(rank + 1), device="cuda:0")
    torch.cuda.synchronize()
    dist.barrier()

    import triton
    import triton.language as tl
    from torch.distributed._symmetric_memory import _nvshmem_triton as nv

    @nv.requires_nvshmem
    @triton.jit
    def put_all(buf_ptr, src_ptr, sig_ptr, out_ptr, me, world, nbytes, epoch, max_polls):
        pe = tl.program_id(0)
        if pe != me:
            dst = buf_ptr + me * (nbytes // 4)
            nv.putmem_signal_block(dst, src_ptr, nbytes, sig_ptr + me, epoch, 0, pe)
        else:
            seen = 0
            for p in range(world):
                if p != me:
                    v = tl.atomic_add(sig_ptr + p, 0, sem="acquire", scope="sys")
                    k = 0
                    while (v < epoch) & (k < max_polls):
                        v = tl.atomic_add(sig_ptr + p, 0, sem="acquire", scope="sys")
                        k += 1
                    seen += (v >= epoch).to(tl.int32)
            tl.store(out_ptr, seen)

    ok = torch.zeros(1, dtype=torch.int32, device="cuda:0")
    t0 = time.time()
    put_all[(world,)](buf, src, sig, ok, rank, world, n * 4, 1, 50_000_000)
    torch.cuda.synchronize()
    got = [float(buf[p * n : (p + 1) * n].float().mean()) for p in range(world)]
    want = [float(p + 1) if p != rank else -1.0 for p in range(world)]
    print(
        f"pe {rank}: put-with-signal {'OK' if got == want and int(ok) == world - 1 else 'WRONG'} "
        f"signals {int(ok)}/{world - 1} blocks {got} ({time.time() - t0:.1f}s)",
        flush=True,
    )
    dist.barrier()

    try:
        rows, dim = 8, 64
        inp = symm.empty(world * rows, dim, dtype=torch.bfloat16, device="cuda:0")
        out = symm.empty(world * rows * 2, dim, dtype=torch.bfloat16, device="cuda:0")
        splits = symm.empty(world, dtype=torch.int64, device="cuda:0")
        so = symm.empty(2, world, dtype=torch.int64, device="cuda:0")
        splits.fill_(rows)
        inp.copy_(torch.arange(world * rows, device="cuda:0").float().add(100 * rank).unsqueeze(1).expand(-1, dim))
        out.fill_(-1)
        torch.ops.symm_mem.all_to_all_vdev(inp, out, splits, so, group)
        torch.cuda.synchronize()
        first = [float(out[p * rows, 0]) for p in range(world)]
        want = [float(100 * p + rank * rows) for p in range(world)]
        print(f"pe {rank}: all_to_all_vdev {'OK' if first == want else 'WRONG'} {first} splits {so.tolist()}", flush=True)
    except Exception as e:
        print(f"pe {rank}: all_to_all_vdev failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pes", type=int, nargs="+", default=[2])
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help="names of VARIANTS; 'mps': under a running MPS server")
    ap.add_argument("--child", nargs=3, type=int)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    for pes in a.pes:
        for name in a.variants:
            env = VARIANTS.get(name, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // pes)})
            print(f"== {pes} PEs on one GPU, variant {name} {env}", flush=True)
            port = _port()
            procs = [
                subprocess.Popen(
                    [sys.executable, __file__, "--child", str(r), str(pes), str(port)],
                    env={**os.environ, **env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for r in range(pes)
            ]
            deadline = time.time() + a.timeout
            for r, p in enumerate(procs):
                try:
                    out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, _ = p.communicate()
                    out += f"\n(pe {r} killed after {a.timeout:.0f}s)"
                lines = [ln for ln in out.splitlines() if ln.strip()]
                keep = [ln for ln in lines if ln.startswith("pe ") or "killed" in ln] + lines[-8:]
                print(f"-- pe {r} rc {p.returncode}", *keep, sep="\n  ", flush=True)
            if all(p.returncode == 0 for p in procs):
                break  # the first variant that works is enough


if __name__ == "__main__":
    main()
