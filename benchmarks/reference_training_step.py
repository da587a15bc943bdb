"""Chapter 9's model in torch, one training step timed (run by ``training_step_bench.py``).

Runs in the optional reference environment (``make reference-env``: torch and
transformers in ``.venv-reference``), never in the book's. Usage::

    .venv-reference/bin/python benchmarks/reference_training_step.py INPUTS.npz OUTPUTS.npz \
        [--repeats N] [--rounds R]

``INPUTS.npz`` holds, for each configuration ``<name>`` (a mixer and a dtype), the
model's parameters under ``<name>/<parameter>`` (the names of
``fixedstate.training``: ``embedding``, ``layers.<i>.W_q``, ...), and ``tokens``,
``targets`` (B, T) and the JSON list ``configs`` (name, mixer, layer ids). The model is
``fixedstate.training.model_forward`` written again with torch operations, so that
autograd gives its backward pass: embedding, per layer RMSNorm, the projections
``W_q, W_k, W_v``, a causal depthwise convolution on each (``conv1d``), the core,
``W_o``, the residual, RMSNorm and the SiLU MLP, then RMSNorm and ``W_head``; the loss
is the cross-entropy over the positions with a target. The cores: transformers'
pure-torch chunked Gated DeltaNet (``torch_chunk_gated_delta_rule`` of Qwen3-Next,
chunk 64; it scales the queries by ``d^-1/2`` itself, so the unit queries go in times
``d^1/2``, and it computes in float32 whatever it is given) with the gates
``beta = sigmoid(u W_b + b_b)`` and ``log g = logsigmoid(u W_a + b_a)`` and
L2-normalised queries and keys; causal ``scaled_dot_product_attention`` for softmax
attention (scale ``1/sqrt(d)``).

Writes, for each configuration, the loss and every parameter's gradient to
``OUTPUTS.npz`` (``<name>/loss``, ``<name>/<parameter>``), so the caller can check
that the two models are the same function, and prints one JSON line: per
configuration the seconds of one step (forward, loss, backward) under torch's
default number of threads and under one thread, each the median over ``rounds`` of
the fastest of ``repeats`` steps, the rounds taken in turns over the configurations.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * weight


def l2_normalize(x, eps=1e-6):
    return x * torch.rsqrt(torch.sum(x * x, dim=-1, keepdim=True) + eps)


def short_conv(x, weight):
    """Causal depthwise convolution: ``y_t = sum_j weight[:, j] x_{t-K+1+j}`` (x (B, T, d), weight (d, K))."""
    d, K = weight.shape
    y = F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), weight[:, None, :], groups=d)
    return y.transpose(1, 2)


def mixer(layer_id, p, L, u):
    q, k, v = (short_conv(u @ p[L + "W_" + n], p[L + "conv_weight_" + n]) for n in "qkv")
    d = q.shape[-1]
    if layer_id == "softmax":
        o = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)[:, 0]
    elif layer_id == "gated_delta":
        beta = torch.sigmoid(u @ p[L + "W_b"] + p[L + "b_b"])
        log_gate = F.logsigmoid(u @ p[L + "W_a"] + p[L + "b_a"])
        q, k = l2_normalize(q), l2_normalize(k)
        o, _ = torch_chunk_gated_delta_rule(q[:, :, None] * math.sqrt(d), k[:, :, None], v[:, :, None],
                                            g=log_gate[:, :, None], beta=beta[:, :, None], chunk_size=64)
        o = o[:, :, 0].to(u.dtype)
    else:
        raise ValueError(f"layer_id: expected 'softmax' or 'gated_delta', got {layer_id!r}")
    return o @ p[L + "W_o"]


def loss_fn(p, layers, tokens, targets):
    x = p["embedding"][tokens]
    for i, layer_id in enumerate(layers):
        L = f"layers.{i}."
        x = x + mixer(layer_id, p, L, rms_norm(x, p[L + "norm_mixer"]))
        h = rms_norm(x, p[L + "norm_mlp"]) @ p[L + "W_1"]
        x = x + F.silu(h) @ p[L + "W_2"]
    logits = rms_norm(x, p["norm_final"]) @ p["W_head"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)


def seconds_per_step(step, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs")
    parser.add_argument("outputs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    data = np.load(args.inputs)
    configs = json.loads(str(data["configs"]))
    tokens = torch.from_numpy(data["tokens"].astype(np.int64))
    targets = torch.from_numpy(data["targets"].astype(np.int64))
    default_threads = torch.get_num_threads()
    steps, outputs = {}, {}
    for c in configs:
        prefix = c["name"] + "/"
        names = [key[len(prefix):] for key in data.files if key.startswith(prefix)]
        params = {n: torch.from_numpy(np.array(data[prefix + n])).requires_grad_(True) for n in names}

        def step(params=params, layers=c["layers"]):
            loss = loss_fn(params, layers, tokens, targets)
            return loss, torch.autograd.grad(loss, list(params.values()))

        loss, grads = step()
        outputs[prefix + "loss"] = np.array(float(loss))
        for n, g in zip(params, grads):
            outputs[prefix + n] = g.numpy()
        steps[c["name"]] = step
    times = {name: {"default": [], "one": []} for name in steps}
    for _ in range(args.rounds):                       # in turns, so that other work on the machine falls on all
        for name, step in steps.items():
            for threads, key in ((default_threads, "default"), (1, "one")):
                torch.set_num_threads(threads)
                times[name][key].append(seconds_per_step(step, args.repeats))
    torch.set_num_threads(default_threads)
    np.savez(args.outputs, **outputs)
    report = {"torch": torch.__version__, "default_threads": default_threads,
              "seconds": {name: {key: float(np.median(v)) for key, v in t.items()} for name, t in times.items()}}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
