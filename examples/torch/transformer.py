"""A small GPT-style transformer on Shard: token and position embeddings, pre-LayerNorm blocks of
causal self-attention and a GELU MLP, an output head (its weight tied to the token embedding's
with --tie, as GPT-2's is), next-token cross-entropy. The job
spec trains it with AdamW, no weight decay for biases, LayerNorms and embeddings (a parameter
group), linear warm-up then cosine decay, and gradient clipping, e.g.:

    "model": {"external": {}},
    "optimizer": {"name": "adamw", "lr": 0.003, "betas": [0.9, 0.95], "weightDecay": 0.1,
                  "paramGroups": [{"match": ["*.bias", "*ln*", "*emb*"], "weightDecay": 0}],
                  "schedule": {"warmupSteps": 20, "decay": "cosine", "minLr": 0.0003}},
    "gradClipNorm": 1.0

The data are generated token sequences from a seeded random Markov chain (every rank makes the
same ones), so the loss has a floor the model can learn towards:

    SHARD_COORDINATOR=127.0.0.1:7460 python3 examples/torch/transformer.py
"""

import argparse
import math

import torch

import shard.torch as shard


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln_attention = torch.nn.LayerNorm(dim)
        # No bias: the keys' part of one would get no gradient (softmax ignores a shift that is
        # the same for every key), so Adam would turn rounding noise into full-size steps.
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.projection = torch.nn.Linear(dim, dim)
        self.ln_mlp = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.ln_attention(x)).split(dim, dim=2)
        shape = (batch, length, self.heads, dim // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(dim // self.heads)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()  # no buffer
        scores = scores.masked_fill(~causal, float("-inf"))
        attended = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, length, dim)
        x = x + self.projection(attended)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln_mlp(x))))


class Gpt(torch.nn.Module):
    def __init__(self, vocab, dim, heads, layers, context, tie=False):
        super().__init__()
        self.token_emb = torch.nn.Embedding(vocab, dim)
        self.position_emb = torch.nn.Embedding(context, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_final = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)
        if tie:
            self.head.weight = self.token_emb.weight  # one parameter under two names

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_emb(tokens) + self.position_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


def markov_sequences(count, length, vocab, seed):
    """`count` sequences of `length + 1` tokens from a sparse random Markov chain."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=generator) * 3
    transitions = logits.softmax(dim=1)
    tokens = torch.empty(count, length + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(vocab, (count,), generator=generator)
    for t in range(length):
        tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1,
                                             generator=generator).squeeze(1)
    return tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--sequences", type=int, default=4096, help="size of the data set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie", action="store_true",
                        help="the output head's weight is the token embedding's")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--bf16", action="store_true",
                        help="forward and backward under torch.autocast in bf16 (on a GPU: "
                        "SHARD_DEVICE=cuda:0)")
    parser.add_argument("--data", help="ignored (scripts/local-cluster.sh passes its MLP data)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    data = markov_sequences(args.sequences, args.context, args.vocab, args.seed)
    torch.manual_seed(args.seed)
    model = Gpt(args.vocab, args.dim, args.heads, args.layers, args.context, tie=args.tie)
    loss_fn = torch.nn.CrossEntropyLoss()

    job = shard.join()
    model.to(job.device)
    data = data.to(job.device)
    engine = job.wrap(model)
    for step in job.steps():
        batch = data[job.batch_indices(step, len(data)).to(job.device)]
        with torch.autocast(job.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(batch[:, :-1])
            loss = loss_fn(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        engine.step()
        job.report(loss=loss.item())
    path = job.finish()
    if path:
        print(f"parameters written to {path}")


if __name__ == "__main__":
    main()
