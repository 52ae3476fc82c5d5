"""cuda_sm100's one-launch send side of the fixed-size expert-parallel dispatch (ep_kernels.ep_pack_kernel)
against the same layout built from torch ops (ep_comm.pack), and the layout itself against its definition."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.registry import load_backend


def _routing(gen: torch.Generator, t: int, k: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(t, experts, generator=gen).argsort(dim=1)[:, :k]
    return ids, torch.rand(t, k, generator=gen) + 0.1


@pytest.mark.parametrize("world,local,k,t,spare", [(2, 4, 2, 7, 3), (2, 32, 6, 33, 0), (4, 2, 3, 1, 5), (8, 4, 8, 19, 2),
                                                   (2, 3, 1, 0, 4), (3, 2, 4, 16, 1), (2, 8, 4, 150, 6)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pack_fixed_matches_torch_pack(gen, world, local, k, t, spare, dtype):
    from deepinfer.backends.cuda_sm100 import ep_comm

    backend = load_backend("cuda_sm100")  # its kernels: the GPU, or the Triton interpreter in CI
    dev = backend.device
    h, cap = 40, t + spare
    x = torch.randn(t, h, generator=gen).to(dtype).to(dev)
    ids, weights = (a.to(dev) for a in _routing(gen, t, k, world * local))
    assert ep_comm.packs_in_one_launch(x)
    send, send_row, sent = ep_comm.pack_fixed(x, ids, weights, world, local, cap)
    want, want_row, want_sent, splits, _, pairs = ep_comm.pack(x, ids, weights, world, local, cap, None)
    assert splits == [cap] * world and pairs is None
    assert send.shape == want.shape == (world * cap, h + 2 * k * 4 // x.element_size())
    assert torch.equal(send_row.cpu(), want_row.cpu()) and torch.equal(sent.cpu(), want_sent.cpu())
    meta, want_meta = (b[:, h:].contiguous().view(torch.float32).cpu() for b in (send, want))
    assert torch.equal(meta, want_meta)  # every slot's routing, the unused ones' ids -1 included
    used = send_row[send_row >= 0].long()
    assert torch.equal(send[used, :h].cpu(), want[used, :h].cpu())

    # The definition: token i goes to rank r iff one of its choices is r's, at r's next free slot in token
    # order, carrying its local ids there (-1 elsewhere) and their weights (0 elsewhere).
    send_row, x, ids, weights = send_row.cpu(), x.cpu(), ids.cpu(), weights.cpu()
    for r in range(world):
        chosen = [i for i in range(t) if (ids[i] // local == r).any()]
        assert send_row[:, r].tolist() == [r * cap + chosen.index(i) if i in chosen else -1 for i in range(t)]
        for n, i in enumerate(chosen):
            row = meta[r * cap + n]
            mine = ids[i] // local == r
            assert row[:k].tolist() == torch.where(mine, ids[i] - r * local, -1).float().tolist()
            assert torch.equal(row[k:], torch.where(mine, weights[i].float(), 0.0))
        assert (meta[r * cap + len(chosen) : (r + 1) * cap, :k] == -1).all()


_SM90_COMPILE = """
import json
import sys
sys.path.insert(0, {bench!r})
from triton_sm90_report import compile_report
from deepinfer.backends.cuda_sm100 import ep_kernels as EK
world, k, local, h = {world}, {k}, {local}, {h}
args = dict(ids_ptr="*i64", w_ptr="*fp32", x_ptr="*bf16", buf_ptr="*bf16", meta_ptr="*fp32", send_row_ptr="*i32",
            sent_ptr="*fp32", T=128, cap=256, stride_x=h, stride_buf=h + 4 * k, stride_meta=(h + 4 * k) // 2)
consts = dict(META_OFF=h // 2, L=local, W=world, W_P=1 << (world - 1).bit_length(), K=k, K_P=1 << (k - 1).bit_length(),
              H=h, BT=16, CT=64, HB=512, BH=128, CS=64, T_C=-1, CAP_C=-1, PDL=False)
print(json.dumps(compile_report(EK.ep_pack_kernel, args, consts, num_warps=4)))
"""


@pytest.mark.parametrize("world,k,local,h", [(2, 8, 128, 7168), (2, 6, 32, 2048), (4, 8, 64, 7168), (8, 8, 32, 7168)])
def test_pack_kernel_compiles_for_sm90(world, k, local, h):
    """The kernel compiles for the H200 (sm_90) at real EP shapes, without a GPU: Triton 3.6 once aborted in its
    scan lowering at 2 ranks x top-8 (a process abort, so the compile runs in its own process)."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    code = _SM90_COMPILE.format(bench=str(bench), world=world, k=k, local=local, h=h)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    if "ptxas" in out.stderr and "No such file" in out.stderr:
        pytest.skip("this Triton install has no ptxas")
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["stack"] == 0, report  # no register spills
