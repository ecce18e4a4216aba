"""Put this folder on PYTHONPATH to record checksums of one training iteration (diagnostics only).

With ``BOUNDED_CHECKSUMS_AT=I`` and ``BOUNDED_CHECKSUMS_OUT=PREFIX`` set, every rank of a
``pretrain_gpt.py`` job writes ``PREFIX_rank<r>.json`` for iteration I: float64 sum and sum of
squares of every parameter before the step and of its ``main_grad`` after it, and a position-
weighted hash of the tokens of each micro-batch. ``tools/diagnostics/checksums.py`` compares two
such records (e.g. an uninterrupted run and a job resumed from its checkpoint). Without the
variables this file does nothing.
"""

import json
import os

if os.environ.get("BOUNDED_CHECKSUMS_AT"):
    import torch
    from megatron.core.models.gpt import gpt_model
    from megatron.training import training

    _ITERATION = int(os.environ["BOUNDED_CHECKSUMS_AT"])
    _PREFIX = os.environ["BOUNDED_CHECKSUMS_OUT"]
    _state = {"active": False, "tokens": []}
    _forward = gpt_model.GPTModel.forward
    _train_step = training.train_step

    def _moments(t):
        t = t.detach().double()
        return [float(t.sum()), float(t.square().sum())]

    def forward(self, input_ids, *args, **kwargs):
        if _state["active"]:
            weights = torch.arange(1, input_ids.numel() + 1, device=input_ids.device)
            _state["tokens"].append(int((input_ids.long().view(-1) * weights).sum()))
        return _forward(self, input_ids, *args, **kwargs)

    def train_step(*args, **kwargs):
        iteration = kwargs.get("iteration")  # completed iterations before this step
        _state["active"] = iteration is not None and iteration + 1 == _ITERATION
        if not _state["active"]:
            return _train_step(*args, **kwargs)
        model = kwargs["model"] if "model" in kwargs else args[2]
        params = {n: _moments(p) for chunk in model for n, p in chunk.named_parameters()}
        outputs = _train_step(*args, **kwargs)
        grads = {
            n: _moments(p.main_grad)
            for chunk in model
            for n, p in chunk.named_parameters()
            if getattr(p, "main_grad", None) is not None
        }
        record = {"iteration": _ITERATION, "params_before": params, "grads_after": grads,
                  "tokens": _state["tokens"]}
        with open(f"{_PREFIX}_rank{torch.distributed.get_rank()}.json", "w") as f:
            json.dump(record, f)
        _state["active"] = False
        return outputs

    gpt_model.GPTModel.forward = forward
    training.train_step = train_step
