"""From a validated request to the engine's SamplingParams, with the checks that need the model's limits.

Length rule (as vLLM): prompt tokens + max_tokens must fit max_model_len; with no max_tokens the request may
generate up to the window's end. Parameters the engine cannot honour yet are refused with a 400 naming
them, never dropped: response_format other than text, best_of != n, suffix. logit_bias maps token ids (as
strings, OpenAI's JSON form) to a bias in [-100, 100] added to their logits before sampling.
`dspark_speculation` / `max_draft_tokens` are per-request speculation controls (False opts the request out;
the cap limits its draft length). Verification is lossless, so they change speed only, never the output
distribution; a server started without speculation accepts them too. The `x-deepinfer-speculation` header
tells a client that set either one which engine serves it ("off" when none does).
"""

from __future__ import annotations

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import InvalidInputError
from deepinfer.serve.errors import BadRequestError
from deepinfer.serve.protocol import ChatCompletionRequest, CompletionRequest

SPECULATION_HEADER = "x-deepinfer-speculation"


def check_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    if isinstance(req, ChatCompletionRequest):
        if req.response_format is not None and req.response_format.type != "text":
            raise BadRequestError(f"response_format {req.response_format.type!r} (structured output) is not supported yet",
                                  param="response_format")
    else:
        if req.suffix:
            raise BadRequestError("suffix (insertion) is not supported", param="suffix")


def check_length(prompt_len: int, max_tokens: int | None, max_model_len: int, *, param: str,
                 tokens_param: str = "max_tokens") -> None:
    if prompt_len >= max_model_len:
        raise BadRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has {prompt_len} "
            "tokens, which leaves no room to generate. Please shorten the prompt.", param=param,
            code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise BadRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the prompt or {tokens_param}.", param=tokens_param, code="context_length_exceeded")


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    skip_special_tokens: bool,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams for `req`; an out-of-range value the engine rejects becomes a 400."""
    try:
        logit_bias = {int(token): bias for token, bias in (req.logit_bias or {}).items()}
    except ValueError:
        raise BadRequestError(f"logit_bias keys must be token ids, got {sorted(req.logit_bias)!r}",
                              param="logit_bias") from None
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            stop=req.stop_list,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            skip_special_tokens=skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=req.n,
            dspark_speculation=req.dspark_speculation,
            max_draft_tokens=req.max_draft_tokens,
            logit_bias=logit_bias,
        )
    except InvalidInputError as err:
        raise BadRequestError(str(err)) from None


def speculation_header(req: ChatCompletionRequest | CompletionRequest, speculative_engine: str) -> dict[str, str]:
    """Tell a client that set a speculation control whether speculation applies to its request."""
    if req.dspark_speculation is None and req.max_draft_tokens is None:
        return {}
    off = speculative_engine == "none" or req.dspark_speculation is False
    return {SPECULATION_HEADER: "off" if off else speculative_engine}
