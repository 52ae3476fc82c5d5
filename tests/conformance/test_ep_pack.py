"""cuda_sm100's one-launch send side of the fixed-size expert-parallel dispatch (ep_kernels.ep_pack_kernel)
against the same layout built from torch ops (ep_comm.pack), and the layout itself against its definition."""

from __future__ import annotations

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
