"""`hf` and `hf-eager`: transformers as a stack. The trainer is a padded `Qwen3(Moe)ForCausalLM`
forward; the rollout is `generate` with its KV cache. Weights are the reference model's, bit for bit.

transformers has no continuous batching: requests that arrive at the same engine step run as one
static, left-padded `generate` batch. Paged-cache options (page size, chunked prefill, permuted
block tables) do not exist there, so the stack declines them. Sampling uses torch's global RNG,
seeded from the first request of the batch, as an HF-based rollout would.

Truncation is generate's own logits processors (temperature, top-k, top-p, min-p, in that order, on fp32
logits); a processed log-prob is log_softmax of generate's `scores` (after the processors), a raw one of
its `logits` (before them). The trainer applies the same processor classes to its own logits: what an
HF-based trainer (TRL) recomputes.
"""

from __future__ import annotations

from itertools import groupby

import torch
import torch.nn.functional as F

from logdiff.api import EngineOptions, Processing, RolloutOutput, Stack, TrainerLayout, Unsupported
from logdiff.baselines.hf_capture import capture_hooks
from logdiff.bisect.capture import capture_logprobs
from logdiff.kernels.logsoftmax import scoring_temperature
from logdiff.weights import own_weights


def build_hf_model(spec, dtype: torch.dtype, attention: str, experts: str | None = None):
    """A transformers model from the spec's config, holding exactly the reference weights: the tensors every
    build of the spec in `dtype` shares (no copy in another dtype; `HFStack.trainer_parameters` copies them
    before a trainer updates them)."""
    import transformers

    config = spec.config()
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    with torch.device("meta"):  # no randomly initialised copy: every parameter is assigned below
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.load_state_dict(spec.build(dtype).state_dict(), strict=True, assign=True)
    model.tie_weights()  # assign= replaced a tied lm_head's Parameter: one again, as the config says
    # The rotary inv_freq buffers are computed, not stored: made again off the meta device, as from_config makes them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_config)
    # .to(dtype) also rounds the rotary inv_freq buffer to the model dtype, as a transformers model cast to it has.
    model = model.to(dtype).eval().requires_grad_(False)
    model.set_attn_implementation(attention)
    if experts and config.is_moe:
        model.set_experts_implementation(experts)
    return model


DEFAULT_LAYOUT = TrainerLayout(padding="right")


class HFStack(Stack):
    supports_capture = True
    # A padded forward, as TRL and verl's padded path run it: right (default) or left, to the longest or beyond.
    trainer_layouts = {"micro_batch": (None, 1, 2), "padding": ("right", "left"), "extra_padding": (0, 5)}

    def __init__(self, spec, dtype, max_model_len, attention: str = "sdpa", experts: str | None = None, name: str = "hf"):
        self.name = name
        self.model = build_hf_model(spec, dtype, attention, experts)
        self.attention = attention
        self.experts = experts

    def describe(self) -> dict:
        import transformers

        info = super().describe()
        info["versions"]["transformers"] = transformers.__version__
        info["attn_implementation"] = self.attention
        info["experts_implementation"] = self.experts or "default"
        return info

    def trainer_parameters(self):
        if not getattr(self, "owns_weights", False):
            own_weights(self.model)
            self.owns_weights = True
        return dict(self.model.named_parameters())

    def sync_weights(self):
        pass  # `generate` runs on the trainer's own model: it already sees every update

    @torch.no_grad()
    def load_weights(self, weights):
        for name, param in self.trainer_parameters().items():
            param.copy_(weights[name])

    def trainer_logprobs(self, sequences, score_from, temperatures, grad=False, capture=None, processing=None,
                         layout: TrainerLayout | None = None):
        layout = layout or DEFAULT_LAYOUT
        if layout.padding not in self.trainer_layouts["padding"]:
            raise Unsupported(f"the transformers trainer pads its batch (right or left), it does not pack ({layout.padding})")
        if layout != DEFAULT_LAYOUT and capture is not None:
            raise Unsupported("a capture follows the default layout (one right-padded forward); score with it to bisect")
        processing = processing or [Processing()] * len(sequences)
        with torch.set_grad_enabled(grad), capture_hooks(self.model, capture, list(range(len(sequences)))):
            out = layout.score(lambda *columns: self._score(*columns, layout), sequences, score_from, temperatures, processing)
        capture_logprobs(capture, list(range(len(sequences))), [first - 1 for first in score_from], out)
        return out

    def _score(self, sequences, score_from, temperatures, processing, layout: TrainerLayout) -> list[torch.Tensor]:
        """One padded forward: position ids count each sequence's own tokens, as verl and TRL pass them, so a
        left-padded sequence keeps its positions."""
        left = layout.padding == "left"
        ids, mask = _padded(sequences, left, layout.extra_padding)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        out = []
        for i, (s, first, temp, proc) in enumerate(zip(sequences, score_from, temperatures, processing)):
            start = ids.shape[1] - len(s) if left else 0
            rows = logits[i, start + first - 1 : start + len(s) - 1].float()
            if proc.logprobs_mode == "raw":
                pass  # log_softmax of the logits at temperature 1
            elif proc.truncates and temp > 0:
                rows = _warpers(temp, proc)(torch.tensor([s[:first]]), rows)
            else:
                rows = rows / scoring_temperature(torch.tensor(temp))
            target = torch.tensor(s[first:])
            out.append(F.log_softmax(rows, dim=-1).gather(1, target[:, None]).squeeze(1).cpu())
        return out

    @torch.no_grad()
    def rollout(self, requests, options: EngineOptions = EngineOptions(), capture=None):
        if options != EngineOptions():
            raise Unsupported("transformers generate has no paged KV cache: no page size, chunked prefill or block tables")
        outputs: dict[int, RolloutOutput] = {}
        indexed = sorted(enumerate(requests), key=lambda ir: ir[1].arrival)
        for _, group in groupby(indexed, key=lambda ir: ir[1].arrival):
            group = list(group)
            for (i, _), out in zip(group, self._generate([r for _, r in group], [i for i, _ in group], capture)):
                outputs[i] = out
        return [outputs[i] for i in range(len(requests))]

    def _generate(self, requests, indices: list[int], capture) -> list[RolloutOutput]:
        if len({(r.max_new_tokens, r.temperature, r.processing) for r in requests}) > 1:
            raise Unsupported("one generate call needs one max_new_tokens, temperature, truncation and log-prob mode "
                              "per batch")
        ids, mask = _padded([r.prompt for r in requests], left=True)
        width = ids.shape[1]
        first = requests[0]
        proc = first.processing
        sampling = dict(do_sample=False)
        if first.temperature > 0:
            torch.manual_seed(first.seed)
            sampling = dict(do_sample=True, temperature=first.temperature, top_k=proc.top_k, top_p=proc.top_p,
                            min_p=proc.min_p or None)
        processed_scores = proc.logprobs_mode == "processed" and proc.truncates and first.temperature > 0
        with capture_hooks(self.model, capture, indices):
            gen = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=first.max_new_tokens, min_new_tokens=first.max_new_tokens,
                output_logits=True, output_scores=processed_scores, return_dict_in_generate=True, pad_token_id=0,
                eos_token_id=None, **sampling,
            )
        tokens = gen.sequences[:, width:]
        if processed_scores:  # after generate's processors: tempered, the dropped tokens at -inf
            logits = torch.stack(gen.scores, dim=1).float()
        else:  # raw logits, before any processor
            scale = 1.0 if proc.logprobs_mode == "raw" else first.temperature
            logits = torch.stack(gen.logits, dim=1).float() / scoring_temperature(torch.tensor(scale))
        logp = F.log_softmax(logits, dim=-1).gather(2, tokens[..., None]).squeeze(2)
        capture_logprobs(capture, indices, [len(r.prompt) - 1 for r in requests], list(logp))
        return [RolloutOutput(t.tolist(), lp.cpu().clone()) for t, lp in zip(tokens, logp)]


def _warpers(temperature: float, processing: Processing):
    """The processors `generate(do_sample=True, ...)` applies for this temperature and truncation, in its order."""
    from transformers import LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
    if processing.top_k:
        warpers.append(TopKLogitsWarper(processing.top_k))
    if processing.top_p < 1.0:
        warpers.append(TopPLogitsWarper(processing.top_p))
    if processing.min_p:
        warpers.append(MinPLogitsWarper(processing.min_p))
    return warpers


def _padded(sequences, left: bool, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, longest + extra]: right-padded for the trainer, left-padded for generate."""
    width = max(len(s) for s in sequences) + extra
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s)
        mask[i, cols] = 1
    return ids, mask


def hf_stack(spec, dtype, max_model_len):
    """transformers forward (trainer) + generate with KV cache (rollout), sdpa attention"""
    return HFStack(spec, dtype, max_model_len, attention="sdpa")


def hf_eager_stack(spec, dtype, max_model_len):
    """transformers forward + generate, eager attention and eager (per-expert loop) MoE experts"""
    return HFStack(spec, dtype, max_model_len, attention="eager", experts="eager", name="hf-eager")
