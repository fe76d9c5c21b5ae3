"""From an OpenAI request to engine requests: prompt token ids and one SamplingParams per choice.

Everything that can be wrong with a request is found here and answered with a 400, before the
engine sees it: the engine thread is shared by every client. The checks run on the HTTP side,
through the engine's RequestValidator (copies of its limits, a thread-safe grammar compiler),
never through the engine itself.
"""

import dataclasses
from dataclasses import dataclass

from tinyllm.engine.request_validator import RequestValidator
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.entrypoints.server.errors import APIError, invalid_params
from tinyllm.entrypoints.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ResponseFormat,
    SamplingRequest,
    TokenIds,
)
from tinyllm.text.tokenizer import Tokenizer
from tinyllm.text.tool_formats import GENERIC, ToolFormat


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # None when the client sent token ids


@dataclass
class Choice:
    index: int  # in the response: prompt by prompt, n per prompt
    prompt: Prompt
    request_id: str  # the engine request of its prompt (n completions)
    completion: int  # which of that request's completions
    params: SamplingParams  # its request's: n completions


@dataclass
class Constraint:
    """What the answer must match, and the request field it came from (errors name it)."""

    params: StructuredOutputsParams
    where: str  # "response_format.json_schema.schema", "structured_outputs.regex", "tools"...


MAX_CHOICES = 256  # engine requests one HTTP request may start (prompts x n)


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens)
    except ValueError as e:  # not text: JSON can carry lone surrogates ("\ud800")
        raise APIError(400, str(e), param=param) from e


def completion_prompts(
    tokenizer: Tokenizer, prompt: str | TokenIds | list[str] | list[TokenIds]
) -> list[Prompt]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: give at least one prompt", param="prompt")
    return [
        Prompt(encode(tokenizer, p, True, "prompt"), p) if isinstance(p, str) else Prompt(p)
        for p in prompt
    ]


def request_constraint(req: SamplingRequest) -> Constraint | None:
    """response_format or vLLM's structured_outputs as StructuredOutputsParams (not both)."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise APIError(
            400, "give response_format or structured_outputs, not both", param="response_format"
        )
    if so is not None:
        try:
            fields = so.model_dump(exclude_none=True, by_alias=True)
            where = f"structured_outputs.{next(iter(fields), '')}".rstrip(".")
            return Constraint(StructuredOutputsParams(**fields), where)
        except ValueError as e:
            message = str(e).removeprefix("StructuredOutputsParams")
            raise APIError(400, f"structured_outputs{message}", param="structured_outputs") from e
    if fmt is None or fmt.type == "text":
        return None
    schema, where = _response_schema(fmt)
    if schema is None:  # json_object without a schema: any JSON object
        return Constraint(StructuredOutputsParams(json_object=True), "response_format")
    return Constraint(StructuredOutputsParams(json=schema), where)


def _response_schema(fmt: ResponseFormat) -> tuple[dict | None, str]:
    """The schema a json_object or json_schema response_format asks for, and where it was:
    OpenAI's `json_schema.schema`, or a `schema` beside the type (clients written for
    Together's or Fireworks' API send it with json_object; llama.cpp and vLLM honour it)."""
    inner = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if inner is not None and fmt.schema_ is not None:
        raise APIError(
            400,
            "response_format: give json_schema.schema or schema, not both",
            param="response_format",
        )
    if inner is not None:
        return inner, "response_format.json_schema.schema"
    if fmt.schema_ is None and fmt.type == "json_schema":
        raise APIError(
            400,
            "response_format: type json_schema needs json_schema.schema",
            param="response_format",
        )
    return fmt.schema_, "response_format.schema"


def chat_prompt(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    tool_format: ToolFormat = GENERIC,
) -> Prompt:
    conversation = []
    for i, m in enumerate(messages):
        message = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            other = [p.type for p in m.content if p.type != "text"]
            if other:
                raise APIError(
                    400,
                    f"messages.{i}.content: only text parts are served, not {other[0]!r}",
                    param="messages",
                )
            message["content"] = "".join(p.text or "" for p in m.content)
        conversation.append(message)
    try:
        text, ids = tokenizer.encode_chat(
            conversation,
            add_generation_prompt,
            tools,
            tool_format=tool_format,
            template_kwargs=template_kwargs,
        )
    except ValueError as e:  # no template, the template refused the conversation, or not text
        raise APIError(400, str(e), param="messages") from e
    return Prompt(ids, text)


def plan_choices(
    validator: RequestValidator,
    request_id: str,
    req: SamplingRequest,
    prompts: list[Prompt],
    max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
    defaults: SamplingParams,
    max_tokens_param: str = "max_tokens",
    constraint: Constraint | None = None,
    prompt_logprobs: int | None = None,
) -> list[Choice]:
    """n choices per prompt, numbered prompt by prompt. A field the request leaves out takes its
    value from `defaults` (the model's recommended settings). `default_max_tokens` None: fill the
    context; an explicit `max_tokens` that does not fit it is an error, a default is cut to fit."""
    vocab = validator.limits.vocab_size
    max_tokens_asked = 1 if max_tokens is None else max_tokens
    base = _params(req, max_tokens_asked, logprobs, vocab, defaults, max_tokens_param)
    base = dataclasses.replace(base, prompt_logprobs=prompt_logprobs)
    if constraint is not None:
        base = dataclasses.replace(base, structured_outputs=constraint.params)
    limit, n = validator.limits.max_model_len, req.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(
            400, f"{len(prompts)} prompts x n={n} is over {MAX_CHOICES} completions", param="n"
        )
    choices = []
    for prompt in prompts:
        try:
            validator.validate(prompt.token_ids, base)
        except ValueError as e:
            if str(e).startswith("SamplingParams."):  # a stop_token_ids or logit_bias id
                raise invalid_params(e) from e
            if str(e).startswith("structured_outputs.") and constraint is not None:
                # It did not compile: say so in the words of the field the client sent.
                detail = str(e).split(": ", 1)[-1]
                where = constraint.where
                raise APIError(400, f"{where}: {detail}", param=where.split(".")[0]) from e
            code = "context_length_exceeded" if len(prompt.token_ids) >= limit else None
            param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            raise APIError(400, str(e), param=param, code=code) from e
        size = len(prompt.token_ids)
        room = limit - size
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{size + max_tokens} tokens ({size} in the prompt, {max_tokens} for the "
                f"completion). Reduce the prompt or {max_tokens_param}.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        budget = max_tokens if max_tokens is not None else min(default_max_tokens or room, room)
        # The engine expands n (and gives each completion its own seed); the server streams
        # what is new each step and keeps the running totals itself.
        params = dataclasses.replace(
            base, n=n, max_tokens=budget, output_kind=RequestOutputKind.DELTA
        )
        first = len(choices)
        engine_id = f"{request_id}-{first // n}"
        choices += [Choice(first + i, prompt, engine_id, i, params) for i in range(n)]
    return choices


def _params(
    req: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    vocab: int,
    d: SamplingParams,
    max_tokens_param: str,
) -> SamplingParams:
    def pick(value, default):
        return default if value is None else value

    top_k = pick(req.top_k, d.top_k)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(req.temperature, d.temperature),
            # Past the vocabulary top_k cuts nothing, and a huge one would overflow in torch.
            top_k=0 if top_k >= vocab else top_k,
            top_p=pick(req.top_p, d.top_p),
            min_p=pick(req.min_p, d.min_p),
            seed=req.seed,
            stop=pick(req.stop, d.stop),
            stop_token_ids=pick(req.stop_token_ids, d.stop_token_ids),
            ignore_eos=pick(req.ignore_eos, d.ignore_eos),
            repetition_penalty=pick(req.repetition_penalty, d.repetition_penalty),
            presence_penalty=pick(req.presence_penalty, d.presence_penalty),
            frequency_penalty=pick(req.frequency_penalty, d.frequency_penalty),
            logprobs=logprobs,
            logit_bias=_logit_bias(req.logit_bias or {}, vocab),
        )
    except ValueError as e:
        error = invalid_params(e)
        if error.param == "max_tokens":  # in the words of the field the client sent
            message = error.message.replace("max_tokens", max_tokens_param, 1)
            error = APIError(400, message, param=max_tokens_param)
        raise error from e


def _logit_bias(bias: dict[str, float], vocab: int) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab):
            raise APIError(
                400, f"logit_bias: {key!r} is not a token id in [0, {vocab})", param="logit_bias"
            )
        out[int(key)] = value  # SamplingParams checks the bias (LOGIT_BIAS_LIMIT)
    return out
