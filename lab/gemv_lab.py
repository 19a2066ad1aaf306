"""GEMV lab (one GPU): the CUDA decode kernel of fluxcompile/csrc/gemv_ar.cu on a one-rank "group" (its math,
epilogue and own-slot stores, no peers) against cuBLAS and a plain streaming read of the weight, all timed as
CUDA graph replays, for kernel variants built side by side (in parallel):

    python lab/gemv_lab.py [--variants cur,NAME=FILE@-DFLAG=1,...] [--shapes 8192x14336,8192x4096] [--ms 1,16,64]

A variant is ``cur`` (the product's gemv_ar.cu as it is), ``NAME=cur`` (the same under another name) or
``NAME=FILE``, each optionally followed by ``@``-separated nvcc flags (``nohint=cur@-DGEMV_WG_HINT=0``: the
kernel's settings in csrc/gemv_ar_tuning.h are macros). FILE is a patch of the product's gemv_ar.cu (``*.patch`` or
``*.diff``, e.g. ``git diff -- fluxcompile/csrc/gemv_ar.cu``), applied to a copy of it, or another whole gemv_ar.cu
with the same headers and binding (e.g. a past version, ``git show REV:fluxcompile/csrc/gemv_ar.cu``). The lab keeps no kernel
sources of its own. Every output is checked against an fp32 reference first. Prints time and weight GB/s per method;
the ``read`` column is the bandwidth ceiling the GEMV could reach, the ``tile*`` columns the same bytes read in the
kernel's tile shapes. ``--tail`` adds the residual + RMSNorm tail; ``--cold`` times every call on a weight that is
not in L2 (a small weight read again and again otherwise stays there, as no model layer's does).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fluxcompile.testing.numerics import rel_err

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "fluxcompile" / "csrc"
CALLS = 20
sys.path.insert(0, str(ROOT / "benchmarks"))
from ops_decode import weight_copies  # noqa: E402


def _build(args: tuple[str, str, list[str]]):
    name, src_dir, flags = args
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    bdir = Path(tempfile.gettempdir()) / f"gemv_lab_{name}"
    bdir.mkdir(exist_ok=True)
    cpp_extension.load(
        name=f"gemv_lab_{name}",
        sources=[f"{src_dir}/gemv_ar.cu", f"{src_dir}/gemv_ar_binding.cpp"],
        extra_cuda_cflags=["-O3", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}", *flags],
        extra_include_paths=[src_dir],
        build_directory=str(bdir),
        with_cuda=True,
    )
    return name, str(bdir)


READ_SRC = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
// Streaming read of a whole tensor (16-byte loads, 4 in flight per thread, grid-stride): the bandwidth ceiling.
__global__ void read_kernel(const uint4* __restrict__ p, long long n16, float* sink) {
  unsigned acc = 0;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 v0 = __ldcs(p + i), v1 = __ldcs(p + i + stride), v2 = __ldcs(p + i + 2 * stride), v3 = __ldcs(p + i + 3 * stride);
    acc ^= v0.x ^ v1.y ^ v2.z ^ v3.w;
  }
  for (; i < n16; i += stride) { uint4 v = __ldcs(p + i); acc ^= v.x; }
  if (acc == 0x12345678u) sink[threadIdx.x] = 1.f;
}
// The same bytes read in the GEMV kernel's shape: CTA b reads the 32 weight rows of tile b over all k, its 8
// warps splitting k, 16 loads of 16 bytes in flight per thread; PAT picks what one warp instruction covers:
// 0: 8 rows x 64 B (csrc's mma-fragment order), 1: 4 rows x 128 B, 2: 2 rows x 256 B, 3: 1 row x 512 B;
// HINT: 0 ld.global.cs, 1 and 2 ld.global.nc with the L2::128B / L2::256B prefetch size.
template <int HINT>
__device__ __forceinline__ uint4 ld_hint(const void* p) {
  uint4 v;
  if (HINT == 0) v = __ldcs(reinterpret_cast<const uint4*>(p));
  if (HINT == 1)
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  if (HINT == 2)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
template <int PAT, int HINT = 0, int CONTIG = 0>
__global__ void __launch_bounds__(256, 2) tile_read(const __nv_bfloat16* __restrict__ w, int n, int k, int ldw,
                                                      float* sink) {
  constexpr int RPI = 8 >> PAT;          // rows per instruction
  constexpr int BPR = 64 << PAT;         // bytes per row per instruction
  constexpr int EPR = BPR / 2;           // elements per row per instruction
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r_in = lane / (32 / RPI), c_in = (lane % (32 / RPI)) * 8;
  const int row0 = blockIdx.x * 32;
  unsigned acc = 0;
  constexpr int IPB = 32 / RPI;          // instructions to cover 32 rows of one k block
  constexpr int KB = 16 / IPB > 0 ? 16 / IPB : 1;  // k blocks per iteration (16 loads)
  constexpr int LOADS = 16;
  // CONTIG: a warp's KB k blocks abut (whole lines per warp) instead of interleaving with the other warps'.
  for (int kb0 = CONTIG ? warp * KB : warp; kb0 * EPR < k; kb0 += 8 * KB)
#pragma unroll
  for (int h = 0; h < IPB * KB / LOADS; ++h) {
    uint4 v[LOADS];
#pragma unroll
    for (int ii = 0; ii < LOADS; ++ii) {
      const int i = h * LOADS + ii;
      const int kb = kb0 + (i / IPB) * (CONTIG ? 1 : 8), q = i % IPB;
      const int row = row0 + q * RPI + r_in, col = kb * EPR + c_in;
      v[ii] = (row < n && col < k) ? ld_hint<HINT>(w + (long long)row * ldw + col) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < LOADS; ++i) acc ^= v[i].x ^ v[i].w;
  }
  if (acc == 0x12345678u) sink[threadIdx.x] = 1.f;
}
void tile_read_all(torch::Tensor w, torch::Tensor sink, int64_t pat) {
  auto s = at::cuda::getCurrentCUDAStream();
  const int n = w.size(0), k = w.size(1), grid = (n + 31) / 32;
  auto p = (const __nv_bfloat16*)w.data_ptr();
  if (pat == 0) tile_read<0><<<grid, 256, 0, s>>>(p, n, k, w.stride(0), sink.data_ptr<float>());
  if (pat == 1) tile_read<1><<<grid, 256, 0, s>>>(p, n, k, w.stride(0), sink.data_ptr<float>());
  if (pat == 2) tile_read<2><<<grid, 256, 0, s>>>(p, n, k, w.stride(0), sink.data_ptr<float>());
  if (pat == 3) tile_read<3><<<grid, 256, 0, s>>>(p, n, k, w.stride(0), sink.data_ptr<float>());
  if (pat == 4) tile_read<0, 1><<<grid, 256, 0, s>>>(p, n, k, w.stride(0), sink.data_ptr<float>());
  if (pat == 5) tile_read<0, 2><<<grid, 256, 0, s>>>(p, n, k, w.stride(0), sink.data_ptr<float>());
  if (pat == 6) tile_read<0, 0, 1><<<grid, 256, 0, s>>>(p, n, k, w.stride(0), sink.data_ptr<float>());
  if (pat == 7) tile_read<0, 2, 1><<<grid, 256, 0, s>>>(p, n, k, w.stride(0), sink.data_ptr<float>());
}
void read_all(torch::Tensor w, torch::Tensor sink) {
  int sms = 0; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, w.get_device());
  read_kernel<<<sms * 4, 512, 0, at::cuda::getCurrentCUDAStream()>>>(
      (const uint4*)w.data_ptr(), w.numel() * w.element_size() / 16, sink.data_ptr<float>());
}
"""


def read_yardstick():
    from torch.utils import cpp_extension

    return cpp_extension.load_inline(
        name="gemv_lab_read", cpp_sources="void read_all(torch::Tensor w, torch::Tensor sink);\n"
        "void tile_read_all(torch::Tensor w, torch::Tensor sink, int64_t pat);",
        cuda_sources="#include <ATen/cuda/CUDAContext.h>\n#include <cuda_bf16.h>\n" + READ_SRC, functions=["read_all", "tile_read_all"],
        extra_cuda_cflags=["-O3"], with_cuda=True,
    )  # fmt: skip


def load_built(name: str, bdir: str):
    import importlib.util

    so = next(Path(bdir).glob(f"gemv_lab_{name}*.so"))
    spec = importlib.util.spec_from_file_location(f"gemv_lab_{name}", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Solo:
    """Workspaces of a one-rank launch (world = 1): the pointers a group's would hold."""

    def __init__(self, m: int, n: int):
        self.slot_bytes = (m * n * 2 + 255) // 256 * 256
        self.data = torch.zeros(4 * self.slot_bytes, dtype=torch.uint8, device="cuda")
        self.flags = torch.zeros(2 * 8192, dtype=torch.int32, device="cuda")
        self.peer_data = torch.tensor([self.data.data_ptr()], dtype=torch.int64, device="cuda")
        self.peer_flags = torch.tensor([self.flags.data_ptr()], dtype=torch.int64, device="cuda")
        self.state = torch.zeros(4, dtype=torch.int32, device="cuda")
        self.err = torch.zeros(8, dtype=torch.int32, device="cuda")


def run(ext, solo: Solo, a, w, out, tail=None):
    """One launch; ``tail = (normed, residual, norm_weight)``: out = residual + A @ w.t(), normed =
    RMSNorm(out) * norm_weight (eps 1e-5)."""
    m, k = a.shape
    n = w.shape[0]
    tiles = -(-n // 32)
    normed, residual, norm_w = (t.data_ptr() for t in tail) if tail is not None else (0, 0, 0)
    ext.launch(
        a.data_ptr(), w.data_ptr(), 0, out.data_ptr(), normed, residual, norm_w, 1e-5, False,
        int(solo.peer_data.data_ptr()), int(solo.peer_flags.data_ptr()), solo.slot_bytes,
        solo.state.data_ptr(), solo.err.data_ptr(), m, n, k, a.stride(0), w.stride(0), 0, 1, False, False, tiles,
        int(5e9), 0, tiles, torch.cuda.current_stream().cuda_stream,
    )  # fmt: skip


def build_variants(spec: str, prefix: str = "") -> dict:
    """The extensions of ``--variants`` (``cur`` or ``NAME=FILE``, FILE a patch or a whole gemv_ar.cu, each with
    ``@``-separated nvcc flags), built in parallel, by name; ``prefix`` keeps another script's builds apart from
    the lab's."""
    jobs = []
    for item in spec.split(","):
        v, *flags = item.split("@")
        name, _, path = v.partition("=")
        src = str(CSRC)
        if path and path != "cur":  # NAME=cur: the product's kernel under another name (with other flags)
            d = Path(tempfile.mkdtemp())
            for f in [*CSRC.glob("*.h"), *CSRC.glob("*.cuh"), CSRC / "gemv_ar_binding.cpp"]:  # what gemv_ar.cu includes
                shutil.copy(f, d / f.name)
            if path.endswith((".patch", ".diff")):
                # -o with the original named: the patch's own file names do not matter.
                subprocess.run(["patch", "-s", "-o", str(d / "gemv_ar.cu"), str(CSRC / "gemv_ar.cu"), path], check=True)
            else:
                shutil.copy(path, d / "gemv_ar.cu")
            src = str(d)
        jobs.append((prefix + name, src, flags))
    with mp.get_context("spawn").Pool(len(jobs)) as pool:
        built = dict(pool.map(_build, jobs))
    return {name: load_built(name, bdir) for name, bdir in built.items()}


ONCE = False  # --once: run each method once, eagerly (for ncu), no timing


def graph_time(fn, reps: int = 30) -> float:
    if ONCE:
        fn()
        torch.cuda.synchronize()
        return float("nan")
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / CALLS)
    times.sort()
    return times[len(times) // 2]


NORM_W: dict = {}


class Weights:
    """The weight for each timed call: ``w`` itself, or with ``cold`` the next of enough identical copies to
    fill twice the L2 cache, so no call finds its weight in L2 (as in a model, whose many layers' weights
    stream from HBM)."""

    def __init__(self, w: torch.Tensor, cold: bool):
        self.copies = weight_copies(w, cold)
        self.i = 0

    def __call__(self) -> torch.Tensor:
        self.i = (self.i + 1) % len(self.copies)
        return self.copies[self.i]


def _tail_inputs(m: int, n: int):
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    norm_w = NORM_W.setdefault(n, torch.randn(n, device="cuda", dtype=torch.bfloat16))
    return residual, norm_w


def _tail_ref(a, w, residual, norm_w):
    h = (residual.float() + (a @ w.t()).float()).to(torch.bfloat16)
    return h, torch.nn.functional.rms_norm(h.float(), (h.shape[1],), norm_w.float(), 1e-5)


def _cublas_tail_time(a, ws: Weights) -> float:
    residual, norm_w = _tail_inputs(a.shape[0], ws.copies[0].shape[0])

    def fn():
        h = torch.addmm(residual, a, ws().t())
        return torch.nn.functional.rms_norm(h, (h.shape[1],), norm_w, 1e-5)

    return graph_time(fn)


def _time_tail(res: dict, v: str, ext, a, ws: Weights, time_wrong: bool) -> None:
    w = ws.copies[0]
    m, n = a.shape[0], w.shape[0]
    residual, norm_w = _tail_inputs(m, n)
    solo = Solo(m, n)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    normed = torch.full_like(out, float("nan"))
    tail = (normed, residual, norm_w)
    run(ext, solo, a, w, out, tail)
    torch.cuda.synchronize()
    h, ref = _tail_ref(a, w, residual, norm_w)
    err = max(rel_err(out, h), rel_err(normed, ref))
    if not err < 1e-2 or solo.err.tolist()[0]:
        print(f"!! {v}+tail n={n} m={m}: rel err {err:.2e}, err words {solo.err.tolist()}", flush=True)
        if not time_wrong:
            return
    res[v + "+tail"] = graph_time(lambda: run(ext, solo, a, ws(), out, tail))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="cur")
    p.add_argument("--shapes", default="8192x14336,8192x4096")
    p.add_argument("--ms", default="1,16,64")
    p.add_argument("--once", action="store_true", help="each method once, eagerly, untimed (to run under ncu)")
    p.add_argument("--time-wrong", action="store_true", help="time variants whose output is wrong (diagnostics)")
    p.add_argument(
        "--tail",
        action="store_true",
        help="also each variant with the residual + RMSNorm tail (`NAME+tail`), "
        "beside cuBLAS followed by torch's add and rms_norm (`cublas+tail`)",
    )
    p.add_argument("--cold", action="store_true", help="each timed call reads a weight that is not in L2 (copies)")
    args = p.parse_args()
    global ONCE
    ONCE = args.once
    exts = build_variants(args.variants)
    try:
        read_ext = read_yardstick()
    except Exception as e:  # the yardstick is optional
        print("read yardstick unavailable:", str(e)[-1500:], flush=True)
        read_ext = None
    sink = torch.zeros(1 << 16, dtype=torch.float32, device="cuda")
    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    rows = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ws = Weights(w, args.cold)
        for m in map(int, args.ms.split(",")):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = a.float() @ w.float().t()
            res = {"cublas": graph_time(lambda a=a, ws=ws: a @ ws().t())}
            if args.tail:
                res["cublas+tail"] = _cublas_tail_time(a, ws)
            if m == 1 and read_ext is not None:
                res["read"] = graph_time(lambda w=w: read_ext.read_all(w, sink))
                # The same bytes in the GEMV's tile shape: 8/4/2/1 rows per instruction; 8 rows with the
                # L2::128B / L2::256B prefetch hints; 8 rows with each warp's k blocks abutting (6), and
                # with the 256B hint too (7).
                for pat in range(8):
                    res[f"tile{pat}"] = graph_time(lambda w=w, pat=pat: read_ext.tile_read_all(w, sink, pat))
            for v, ext in exts.items():
                solo = Solo(m, n)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                try:
                    run(ext, solo, a, w, out)
                    torch.cuda.synchronize()
                except RuntimeError as e:
                    print(f"!! {v} n={n} k={k} m={m}: {e}", flush=True)
                    continue
                err = rel_err(out, ref)
                bad = solo.err.tolist()
                if not err < 1e-2 or bad[0]:
                    print(f"!! {v} n={n} k={k} m={m}: rel err {err:.2e}, err words {bad}", flush=True)
                    if not args.time_wrong:
                        continue
                res[v] = graph_time(lambda e=ext, s=solo, a=a, o=out, ws=ws: run(e, s, a, ws(), o))
                if args.tail:
                    _time_tail(res, v, ext, a, ws, args.time_wrong)
            gb = w.numel() * 2
            line = f"n={n:6d} k={k:6d} m={m:3d} " + " ".join(
                f"{name} {t:6.1f}us {gb / t / 1e3:5.0f}GB/s" for name, t in res.items()
            )
            print(line, flush=True)
            rows.append(line)
    print("== lab table")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
