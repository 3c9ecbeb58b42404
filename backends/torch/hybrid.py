"""Qwen3.5's linear-attention layers (Gated DeltaNet) in the batched decoder: a fixed-size state per
sequence beside the paged KV of its attention layers (`RowStates`), and the layer's token mixing
over it, for a decode step's rows (`decode_mix`) and a prompt piece (`piece_mix`).

A layer's state is the short convolution's last inputs ([conv_dim, kernel - 1]) and the delta
rule's recurrent matrix ([value heads, key dim, value dim], float32 as transformers keeps it). The
recurrence is transformers' own (`torch_recurrent_gated_delta_rule` for a step,
`torch_chunk_gated_delta_rule` for a piece, each from the state a row holds), so the numbers are
its numbers. The states move with their rows (`move`) and start at zeros with a prompt's first
piece. What falls back, and why: a state is not kept at page boundaries, so the prompt cache is
off for these models (a stored prefix's keys and values say nothing of the states); drafts are
not verified (a rejected token has already changed the state); no CUDA graphs, Triton step or
compiled CPU step (their kernels know attention layers only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.torch.quant.methods import linear


def gated_delta_rules():
    """transformers' reference recurrences (imported on use: the module is Qwen3.5's modelling)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    return qwen.torch_recurrent_gated_delta_rule, qwen.torch_chunk_gated_delta_rule


class RowStates:
    """Each row's state in each linear-attention layer, rows as the decoder packs them."""

    def __init__(self, arch, rows: int, device, dtype):
        delta = arch.delta
        self.slot = {layer: i for i, layer in enumerate(i for i, m in enumerate(arch.mixers) if m == "delta")}
        layers = len(self.slot)
        self.conv = torch.zeros(layers, rows + 1, delta.conv_dim, delta.kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            layers, rows + 1, delta.v_heads, delta.k_dim, delta.v_dim, dtype=torch.float32, device=device
        )  # (the row past the rest: a check's prompt, `BatchedDecoder.logits_after`)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    @staticmethod
    def bytes_for(arch, rows: int, dtype) -> int:
        """What `RowStates(arch, rows, ...)` holds."""
        delta, layers = arch.delta, arch.mixers.count("delta")
        conv = delta.conv_dim * (delta.kernel - 1) * torch.empty(0, dtype=dtype).element_size()
        return layers * (rows + 1) * (conv + delta.v_heads * delta.k_dim * delta.v_dim * 4)

    @staticmethod
    def budget_left(weights, rows: int, kv_cache_bytes: int | None) -> int | None:
        """The KV budget (None: unbounded) less the rows' states, which it pays for first (the
        same budget for any other model)."""
        if kv_cache_bytes is None or not weights.arch.hybrid:
            return kv_cache_bytes
        return kv_cache_bytes - RowStates.bytes_for(weights.arch, rows, weights.embed.dtype)

    def reset(self, row: int) -> None:
        self.conv[:, row].zero_()
        self.recurrent[:, row].zero_()

    def move(self, targets: list[int], sources: list[int]) -> None:
        if targets:
            self.conv[:, targets] = self.conv[:, sources]
            self.recurrent[:, targets] = self.recurrent[:, sources]


def _project(h, block, delta):
    """The layer's projections of h [n, hidden]: q, k, v before the convolution ([n, conv_dim]),
    z (the output gate), b (beta's) and a (the decay's)."""
    y = linear(h, block.w_in, block.b_in)
    qkv, z, b, a = torch.split(y, [delta.conv_dim, delta.value_size, delta.v_heads, delta.v_heads], dim=-1)
    return qkv, z, b, a


def _heads(mixed, b, a, block, delta):
    """q, k [1, n, k_heads, k_dim], v [1, n, v_heads, v_dim], decay g and beta [1, n, v_heads]."""
    n = mixed.shape[0]
    q, k, v = torch.split(mixed, [delta.key_size, delta.key_size, delta.value_size], dim=-1)
    g = -block.a_log.float().exp() * F.softplus(a.float() + block.dt_bias)
    return (
        q.reshape(1, n, delta.k_heads, delta.k_dim),
        k.reshape(1, n, delta.k_heads, delta.k_dim),
        v.reshape(1, n, delta.v_heads, delta.v_dim),
        g[None],
        b.sigmoid()[None],
    )


def _out(core, z, block, delta, eps):
    """The gated RMSNorm (the weight as it is, then silu of z): what the output projection takes
    (`network.mlp_and_residual` applies it, as it applies attention's)."""
    shape = core.shape
    h = core.reshape(-1, delta.v_dim)
    dtype = h.dtype
    h = h.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = block.mix_norm * h.to(dtype)
    h = (h * F.silu(z.reshape(-1, delta.v_dim).float())).to(dtype)
    return h.reshape(*shape[:-2], delta.value_size)


def decode_mix(h, block, states: RowStates, layer: int, rows: torch.Tensor, active: torch.Tensor, delta, eps):
    """One token for each row (h [b, hidden], the normed input): the mixed values [b, value_size],
    the rows' states advanced where `active` (an idle row's stays as it was)."""
    recurrent_rule, _ = gated_delta_rules()
    slot = states.slot[layer]
    qkv, z, b, a = _project(h, block, delta)
    window = torch.cat((states.conv[slot, rows], qkv[:, :, None]), dim=-1)  # [b, conv_dim, kernel]
    mixed = F.silu((window * block.conv[None]).sum(-1))
    batch = h.shape[0]
    q, k, v, g, beta = _heads(mixed, b, a, block, delta)
    # the rows as the batch, one position each
    q, k, v = (t.reshape(batch, 1, *t.shape[2:]) for t in (q, k, v))
    g, beta = g.reshape(batch, 1, -1), beta.reshape(batch, 1, -1)
    core, state = recurrent_rule(
        q, k, v, g=g, beta=beta, initial_state=states.recurrent[slot, rows], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    keep = active.bool()
    states.conv[slot, rows] = torch.where(keep[:, None, None], window[:, :, 1:], states.conv[slot, rows])
    states.recurrent[slot, rows] = torch.where(keep[:, None, None, None], state, states.recurrent[slot, rows])
    return _out(core[:, 0], z.reshape(batch, delta.v_heads, delta.v_dim), block, delta, eps)


def piece_mix(h, block, states: RowStates, layer: int, row: int, start: int, delta, eps):
    """A prompt piece of one row (h [n, hidden], its tokens from position `start`): the mixed
    values [n, value_size], the row's state advanced past it (from zeros where the piece starts the
    prompt)."""
    _, chunk_rule = gated_delta_rules()
    slot = states.slot[layer]
    if start == 0:
        states.conv[slot, row].zero_()
        states.recurrent[slot, row].zero_()
    n = h.shape[0]
    qkv, z, b, a = _project(h, block, delta)
    inputs = torch.cat((states.conv[slot, row], qkv.t()), dim=-1)  # [conv_dim, kernel - 1 + n]
    mixed = F.conv1d(inputs[None], block.conv[:, None, :], groups=delta.conv_dim)[0]  # [conv_dim, n]
    states.conv[slot, row] = inputs[:, -(delta.kernel - 1) :]
    q, k, v, g, beta = _heads(F.silu(mixed).t(), b, a, block, delta)
    core, state = chunk_rule(
        q, k, v, g=g, beta=beta, initial_state=states.recurrent[slot, row][None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    states.recurrent[slot, row] = state[0]
    return _out(core[0], z.reshape(n, delta.v_heads, delta.v_dim), block, delta, eps)
