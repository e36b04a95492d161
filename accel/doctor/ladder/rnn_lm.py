"""An LSTM language model (2 layers of 650, vocabulary 33278, 35 steps of backpropagation
through time) as PyTorch's word_language_model example trains it, 64 sequences a batch: first the
example's loop (parameters updated by hand one tensor at a time, float32, the loss read every
step, a pageable batch); then fused SGD (the same rule), autocast (cuDNN's LSTM runs float16
whatever is asked), TF32, a pinned batch. Not compiled: the LSTM stays one cuDNN kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from accel.doctor.ladder import Script, sizes, tuned_backends

SEED = 1111  # the example's --seed
total_loss = 0.0


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int):
        super().__init__()
        self.ntoken = ntoken
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        self.init_weights()

    def init_weights(self) -> None:
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input: torch.Tensor, hidden):
        emb = self.encoder(input)
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid))  # fmt: skip


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def settings(preset: str) -> dict:
    return sizes(preset, gpu=dict(ntokens=33278, emsize=650, nhid=650, nlayers=2, bptt=35,
                                  batch_size=64),
                 cpu=dict(ntokens=97, emsize=16, nhid=16, nlayers=2, bptt=5, batch_size=4))


def make_model(size: dict, device: torch.device) -> RNNModel:
    """The network, its weights drawn from a seed of their own (the caller's random state kept)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = RNNModel(size["ntokens"], size["emsize"], size["nhid"], size["nlayers"])
    return model.to(device)


def get_batch(size: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``bptt`` rows of the batchified corpus (random words here) and the words that follow
    them, flattened as the loss wants them; on the host."""
    generator = torch.Generator().manual_seed(SEED)
    shape = (size["bptt"] + 1, size["batch_size"])
    source = torch.randint(size["ntokens"], shape, generator=generator)
    return source[:-1], source[1:].reshape(-1)


def first_written(device: torch.device, preset: str) -> Script:
    size = settings(preset)
    model = make_model(size, device)
    criterion = nn.NLLLoss()
    lr, clip = 20.0, 0.25
    hidden = model.init_hidden(size["batch_size"])
    model.train()

    def step(batch):
        global total_loss
        nonlocal hidden
        data, targets = batch
        data, targets = data.to(device), targets.to(device)  # ground truth: input
        # truncated backpropagation: the state goes on, the previous batch's graph does not
        hidden = repackage_hidden(hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)  # ground truth: precision
        loss = criterion(output, targets)
        loss.backward()
        # against exploding gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)  # ground truth: tensor_loop
        total_loss += loss.item()  # ground truth: sync
        return loss

    return Script("rnn_lm", step, get_batch(size))


def hand_optimized(device: torch.device, preset: str) -> Script:
    size = settings(preset)
    model = make_model(size, device)
    criterion = nn.NLLLoss()
    clip = 0.25
    optimizer = torch.optim.SGD(model.parameters(), lr=20.0, fused=True)  # p -= lr * grad
    hidden = model.init_hidden(size["batch_size"])
    model.train()
    cuda = device.type == "cuda"

    def step(batch):
        nonlocal hidden
        with tuned_backends():
            data, targets = (t.to(device, non_blocking=True) for t in batch)
            hidden = repackage_hidden(hidden)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                output, hidden = model(data, hidden)
                loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            return loss.detach()  # summed on the device, read every log_interval batches

    batch = get_batch(size)
    if cuda:
        batch = tuple(t.pin_memory() for t in batch)
    return Script("rnn_lm", step, batch)
