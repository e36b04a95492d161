"""The rollout and scoring step of a polychromic trainer: N replies per prompt, scored for
quality and semantic diversity.

A small GPT writes N replies to each of B prompts; an encoder embeds every reply; each prompt's
score is the replies' mean log-probability (quality) plus ``DIVERSITY_WEIGHT`` times their mean
pairwise cosine distance (``accel.diversity``). The policy update that would follow is the same
before and after, and is left out of the step. ``Flags()`` is the step as first written.

Decoding is the Gumbel-max trick: token = argmax(logits + g), the noise g drawn up front for
every prompt, reply, position and vocabulary entry. That samples from softmax(logits), yet each
decision is an argmax of the same numbers however the replies are batched, so batched decoding
reproduces one-at-a-time decoding (up to near-ties: :func:`tokens_agree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from accel import diversity
from accel.workloads.byte_gpt import Block
from accel.workloads.compare import Tolerance
from accel.workloads.compare import compare_results as check
from accel.workloads.flags import Presets, flag

DIVERSITY_WEIGHT = 0.5
TIE_MARGIN = 1e-4  # logits closer than this may be ordered differently by another batching
RTOL, ATOL = 1e-4, 1e-5


@dataclass(frozen=True)
class Flags:
    batched_generation: bool = flag(
        "decode all N replies of all prompts as one batch with a static KV cache, "
        "instead of one reply at a time",
        "diversity",
    )
    batched_encoding: bool = flag(
        "embed all replies in one encoder call instead of one call per reply", "diversity"
    )
    triton_diversity: bool = flag(
        "pairwise-cosine diversity by the fused Triton kernel instead of the N x N matrix",
        "diversity",
        requires="triton",
    )


@dataclass(frozen=True)
class Sizes(Presets):
    prompts: int = 2  # B
    replies: int = 4  # N per prompt
    prompt_len: int = 8
    reply_len: int = 12
    vocab: int = 64
    width: int = 64  # generator
    depth: int = 2
    heads: int = 2
    embed_dim: int = 32  # encoder width = embedding size D
    embed_depth: int = 1
    embed_heads: int = 2
    batches: int = 2  # distinct prompt sets cycled through


Sizes.PRESETS = {
    "cpu": Sizes(),
    # 64 replies of 24 tokens, decoded one by one in the baseline; D = 384 as all-MiniLM-L6-v2
    "gpu": Sizes(
        prompts=16,
        replies=4,
        prompt_len=16,
        reply_len=24,
        vocab=2048,
        width=256,
        depth=4,
        heads=4,
        embed_dim=384,
        embed_depth=2,
        embed_heads=6,
    ),
}


class Transformer(nn.Module):
    """Token and position embeddings, blocks, a final norm; with a ``head``, a language model."""

    def __init__(self, vocab: int, width: int, heads: int, depth: int, max_len: int, head: bool):
        super().__init__()
        self.max_len = max_len
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(Block(width, heads, gelu="none") for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False) if head else None

    def new_cache(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A static KV cache at full length, allocated once (gpt-fast's layout); its zeros are
        never read: attention only sees positions already written."""
        blk = self.blocks[0]
        shape = (batch, blk.heads, self.max_len, blk.qkv.in_features // blk.heads)
        zeros = self.ln.weight.new_zeros
        return [(zeros(shape), zeros(shape)) for _ in self.blocks]

    def decode(self, idx: torch.Tensor, cache, pos: int) -> torch.Tensor:
        """Logits of the last position; ``idx`` (b, t) are tokens at positions pos..pos+t-1."""
        x = self.tokens(idx) + self.positions.weight[pos : pos + idx.shape[1]]
        for block, layer_cache in zip(self.blocks, cache, strict=True):
            x = block(x, layer_cache, pos)
        return self.head(self.ln(x[:, -1]))

    def embed(self, replies: torch.Tensor) -> torch.Tensor:
        """(r, L) tokens -> (r, width): mean-pooled states of a bidirectional pass."""
        x = self.tokens(replies) + self.positions.weight[: replies.shape[1]]
        for block in self.blocks:
            x = block(x, causal=False)
        return self.ln(x).mean(1)


def gumbel(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Gumbel(0, 1) noise: argmax(logits + g) samples from softmax(logits)."""
    u = torch.rand(shape, generator=generator).clamp_(1e-9, 1 - 1e-9)
    return -torch.log(-torch.log(u))


class Step:
    """Generate, embed and score one batch of prompts per call."""

    def __init__(self, flags: Flags = Flags(), sizes: Sizes = Sizes(), *, device="cpu", seed=0):
        device = torch.device(device)
        self.flags, self.sizes, self.device, s = flags, sizes, device, sizes
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            length = s.prompt_len + s.reply_len
            self.generator = Transformer(s.vocab, s.width, s.heads, s.depth, length, head=True)
            self.encoder = Transformer(
                s.vocab, s.embed_dim, s.embed_heads, s.embed_depth, s.reply_len, head=False
            )
        self.generator.to(device).eval()
        self.encoder.to(device).eval()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.prompts = torch.randint(
            s.vocab, (s.batches, s.prompts, s.prompt_len), generator=gen
        ).to(device)
        self.noise = gumbel((s.batches, s.prompts, s.replies, s.reply_len, s.vocab), gen).to(device)
        rows = s.prompts * s.replies
        # Allocated once: the batched decode's cache for B N sequences, or one sequence's.
        self.cache = self.generator.new_cache(rows if flags.batched_generation else 1)
        self.count = 0
        self.last: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def __call__(self) -> None:
        i = self.count % self.sizes.batches
        prompts, noise = self.prompts[i], self.noise[i]  # (B, P), (B, N, L, V)
        if self.flags.batched_generation:
            tokens, logp, margin = self._generate_batched(prompts, noise)
        else:
            tokens, logp, margin = self._generate_one_at_a_time(prompts, noise)
        emb = self._embed(tokens)  # (B, N, D)
        # the reference: the N x N matrix in PyTorch
        fast = self.flags.triton_diversity
        div = (diversity.mean_diversity if fast else diversity.mean_diversity_reference)(emb)
        quality = logp.mean((1, 2))  # mean log-probability of the chosen tokens
        self.last = {
            "tokens": tokens,
            "embeddings": emb,
            "diversity": div,
            "quality": quality,
            "reward": quality + DIVERSITY_WEIGHT * div,
            "margin": margin,
        }
        self.count += 1

    def _decode(self, prompt: torch.Tensor, noise: torch.Tensor, cache):
        """Greedy over perturbed logits for ``prompt`` (r, P) with ``noise`` (r, L, V)."""
        steps = noise.shape[1]
        logits = self.generator.decode(prompt, cache, 0)
        tokens, logps, margins = [], [], []
        for t in range(steps):
            scores = logits + noise[:, t]
            top2 = scores.topk(2, dim=-1)
            token = top2.indices[:, :1]  # (r, 1)
            margins.append(top2.values[:, 0] - top2.values[:, 1])
            logps.append(logits.log_softmax(-1).gather(-1, token)[:, 0])
            tokens.append(token)
            if t + 1 < steps:
                logits = self.generator.decode(token, cache, prompt.shape[1] + t)
        return torch.cat(tokens, 1), torch.stack(logps, 1), torch.stack(margins, 1)

    def _generate_one_at_a_time(self, prompts, noise):
        """The plain loop: a generate() call per reply, each prefilling its own cache."""
        B, N, L, _ = noise.shape
        outs = [
            self._decode(prompts[b : b + 1], noise[b, r : r + 1], self.cache)
            for b in range(B)
            for r in range(N)
        ]  # B N results of (1, L) tokens, log-probs and margins, in the batched order
        return tuple(torch.cat(parts).view(B, N, L) for parts in zip(*outs, strict=True))

    def _generate_batched(self, prompts, noise):
        B, N, L, V = noise.shape
        rows = prompts.repeat_interleave(N, dim=0)  # (B N, P): reply r of prompt b at b N + r
        tokens, logp, margin = self._decode(rows, noise.reshape(B * N, L, V), self.cache)
        return tokens.view(B, N, L), logp.view(B, N, L), margin.view(B, N, L)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        B, N, L = tokens.shape
        flat = tokens.reshape(B * N, L)
        if self.flags.batched_encoding:
            emb = self.encoder.embed(flat)
        else:  # one reply at a time, as an encode() call per reply
            emb = torch.cat([self.encoder.embed(flat[j : j + 1]) for j in range(B * N)])
        return emb.view(B, N, -1)

    def result(self) -> dict[str, torch.Tensor]:
        """The last step's tokens, embeddings and scores (and decoding margins, not compared)."""
        if not self.last:
            raise RuntimeError("run the step at least once before asking for its result")
        return {k: v.clone() for k, v in self.last.items()}


build = Step  # build(flags, sizes, *, device, seed): the contract's name for the step


def tokens_agree(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """True if two results' replies are equal, or each first differs at a near-tie (a top-two
    margin below ``TIE_MARGIN`` in either run), where another batching's rounding may pick the
    other token legitimately."""
    same = a["tokens"] == b["tokens"]  # (B, N, L)
    differs = ~same.all(-1)
    if not differs.any():
        return True
    first = (~same).int().argmax(-1, keepdim=True)  # first differing position per reply
    margin = torch.minimum(a["margin"].gather(-1, first), b["margin"].gather(-1, first))[..., 0]
    return bool((margin[differs] < TIE_MARGIN).all())


def tolerance(flags: Flags, sizes: Sizes, steps: int) -> dict[str, Tolerance | None]:
    """Per entry of ``step.result()``: the scores within ``RTOL`` / ``ATOL`` (float32 sums in
    another order) for every flag, size and step count; tokens and margins not compared by
    value (None): the tokens are held to :func:`tokens_agree`, the margins only explain it."""
    scores = {"rtol": RTOL, "atol": ATOL}
    keys = ("embeddings", "diversity", "quality", "reward")
    return {"tokens": None, "margin": None, **dict.fromkeys(keys, scores)}


def compare_results(result, reference, flags: Flags, *, sizes: Sizes, steps: int) -> dict:
    """Tokens equal (near-ties aside: :func:`tokens_agree`); with equal tokens, the scores
    within :func:`tolerance`, each one's largest difference relative to its largest value
    returned (none where a near-tie changed a reply: its scores are another reply's)."""
    assert tokens_agree(result, reference), "replies differ away from any near-tie"
    if not torch.equal(result["tokens"], reference["tokens"]):
        return {}
    return check(result, reference, tolerance(flags, sizes, steps))
