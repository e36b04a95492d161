"""A BERT-base encoder (post-LN, GELU) trained on masked language modelling over padded
sequences, written as Hugging Face's ``modeling_bert``: first float32, attention written out
with the additive -10000 mask, default AdamW, the loss read every step, a pageable batch; then as
NVIDIA's pretraining (vocabulary padded to 30528, SDPA with a boolean mask, bf16, TF32, fused
AdamW, ``torch.compile`` with CUDA graphs, a pinned batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from accel.doctor.ladder import Script, compiled, sizes, tuned_backends

SEED = 42
PAD, MASK = 0, 103  # [PAD] and [MASK] in BERT's vocabulary; words come after [MASK]
IGNORE = -100  # the label of a token that was not masked
logged: list[float] = []


@dataclass
class BertConfig:
    vocab_size: int = 30522  # ground truth: odd_shape
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 4 * 768
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    sdpa: bool = False  # scaled_dot_product_attention in place of the written-out attention


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=PAD)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device)
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.LayerNorm(embeddings + self.token_type_embeddings(token_type_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.sdpa = config.sdpa

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        new_shape = (*x.size()[:-1], self.num_attention_heads, self.attention_head_size)
        return x.view(new_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        if self.sdpa:
            context_layer = F.scaled_dot_product_attention(
                query_layer, key_layer, value_layer, attn_mask=attention_mask
            )
        else:
            scores = query_layer @ key_layer.transpose(-1, -2)  # ground truth: attention
            scores = scores / math.sqrt(self.attention_head_size)
            scores = scores + attention_mask  # -10000.0 at padding
            probs = nn.functional.softmax(scores, dim=-1)
            context_layer = torch.matmul(probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(*context_layer.size()[:-2], -1)


class BertLayer(nn.Module):
    """Self-attention and the feed-forward network, each added to its input and normalised."""

    def __init__(self, config: BertConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.attention = BertSelfAttention(config)
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        attention = self.attention_output(self.attention(hidden_states, attention_mask))
        hidden_states = self.attention_norm(attention + hidden_states)
        intermediate = F.gelu(self.intermediate(hidden_states))
        return self.output_norm(self.output(intermediate) + hidden_states)


class BertForMaskedLM(nn.Module):
    def __init__(self, config: BertConfig, seed: int = SEED):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.transform = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.decoder.weight = self.embeddings.word_embeddings.weight
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        """Hugging Face's: weights from N(0, 0.02), biases zero, the padding row zero; drawn
        from a generator of their own, the word embeddings (the decoder's weight) last, so a
        padded vocabulary only adds rows at the end and every other weight stays the same."""
        generator = torch.Generator().manual_seed(seed)
        word = self.embeddings.word_embeddings
        tied = (word, self.decoder)
        for module in [*(m for m in self.modules() if m not in tied), word]:
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=generator)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)
        nn.init.zeros_(self.decoder.bias)
        with torch.no_grad():
            word.weight[PAD].zero_()

    def forward(self, input_ids, token_type_ids, attention_mask, labels) -> torch.Tensor:
        if self.config.sdpa:
            extended_attention_mask = attention_mask[:, None, None, :].bool()  # True: attend
        else:
            extended_attention_mask = attention_mask[:, None, None, :].to(torch.float32)
            extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        hidden_states = self.embeddings(input_ids, token_type_ids)
        for layer in self.layer:
            hidden_states = layer(hidden_states, extended_attention_mask)
        hidden_states = self.transform_norm(F.gelu(self.transform(hidden_states)))
        prediction_scores = self.decoder(hidden_states)
        return F.cross_entropy(
            prediction_scores.view(-1, prediction_scores.size(-1)), labels.view(-1),
            ignore_index=IGNORE,
        )  # fmt: skip


def settings(preset: str) -> tuple[BertConfig, int, int]:
    """The model's configuration, the batch size and the sequence length."""
    size = sizes(
        preset,
        gpu=dict(batch=32, seq=256),
        cpu=dict(
            batch=4, seq=16, vocab_size=250, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=64, max_position_embeddings=16,
        ),
    )  # fmt: skip
    batch, seq = size.pop("batch"), size.pop("seq")
    return BertConfig(**size), batch, seq


def get_batch(config: BertConfig, batch: int, seq: int) -> dict[str, torch.Tensor]:
    """Sequences of random lengths padded to ``seq``, two segments each, 15% of their tokens
    replaced by [MASK] and kept as labels; on the host."""
    generator = torch.Generator().manual_seed(SEED)
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=generator)
    positions = torch.arange(seq)
    attention_mask = (positions < lengths[:, None]).long()
    words = torch.randint(MASK + 1, config.vocab_size, (batch, seq), generator=generator)
    words = words * attention_mask  # [PAD] past each length
    masked = (torch.rand(batch, seq, generator=generator) < 0.15) & attention_mask.bool()
    second = (torch.rand(batch, generator=generator) * lengths).long()  # where segment B starts
    return dict(
        input_ids=torch.where(masked, MASK, words),
        token_type_ids=(positions >= second[:, None]).long() * attention_mask,
        attention_mask=attention_mask,
        labels=torch.where(masked, words, IGNORE),
    )


def first_written(device: torch.device, preset: str) -> Script:
    config, batch, seq = settings(preset)
    with torch.random.fork_rng(devices=[]):
        model = BertForMaskedLM(config).to(device)  # ground truth: fusion
    optimizer = torch.optim.AdamW(  # ground truth: optimizer_unfused
        model.parameters(), lr=1e-4, weight_decay=0.01
    )
    model.train()

    def step(batch):
        batch = {k: v.to(device) for k, v in batch.items()}  # ground truth: input
        loss = model(**batch)  # ground truth: precision
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        logged.append(loss.item())  # ground truth: sync
        return loss

    return Script("bert", step, get_batch(config, batch, seq))


def hand_optimized(device: torch.device, preset: str) -> Script:
    config, batch, seq = settings(preset)
    data = get_batch(config, batch, seq)  # the tokenizer's vocabulary, as before
    # 30528 for BERT's 30522: a multiple of 64, whose products tile evenly
    padded = replace(config, vocab_size=-(-config.vocab_size // 64) * 64, sdpa=True)
    with torch.random.fork_rng(devices=[]):
        model = BertForMaskedLM(padded).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    model.train()
    model = compiled(model, device)
    cuda = device.type == "cuda"

    def step(batch):
        with tuned_backends():
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(**batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()  # logged every so many steps

    if cuda:
        data = {k: v.pin_memory() for k, v in data.items()}
    return Script("bert", step, data, compiled=True)
