"""The OpenAI request bodies ``specjax serve`` accepts, as pydantic models: ``CompletionRequest`` and
``ChatCompletionRequest`` (the fields this server knows, their types, ranges and defaults; any other field is
refused), and ``parse_request``, which turns a body into the batcher's submission or raises a ``BadRequest``
whose message is the server's own wording and whose ``param`` names the offending field.

Fields OpenAI defines but this server does not implement (``NEUTRAL``) are accepted only at their no-effect
value (or null).  ``max_tokens`` / ``max_completion_tokens`` default to the server's ``--default-max-tokens``;
``temperature``, ``top_p`` and ``top_k`` to the server's own sampling settings.  ``speculation`` (specjax's
own field) is the text of the bucket a request wants ("off", "k=4", "branch:2,2,1"; null: the server's policy
decides), checked against the running server's buckets by the route (``buckets.pin_key``).  When several
fields are bad, unknown fields are reported first, then the first bad field in ``CHECK_ORDER``."""
from __future__ import annotations

from typing import Annotated, Any, Callable, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat,
                      StrictInt, StrictStr, ValidationError, ValidationInfo, WrapValidator, model_validator)
from pydantic.json_schema import SkipJsonSchema, models_json_schema
from pydantic_core import PydanticCustomError

from specjax.models import sampling

NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "echo": False, "best_of": 1,
           "suffix": None, "logit_bias": None, "response_format": None, "tools": None,
           "tool_choice": None, "parallel_tool_calls": None}
# The order the fields are judged in: of several bad fields, the first here is the one reported.
CHECK_ORDER = (*NEUTRAL, "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "top_logprobs", "logprobs", "stop", "stream", "messages", "prompt", "stream_options", "speculation")
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
Say = Callable[[str, Any, str], str]       # (field name, value sent, pydantic's error type) → the message


class BadRequest(Exception):
  def __init__(self, message: str, status: int = 400, param: str | None = None):
    super().__init__(message)
    self.status, self.param = status, param


# ----------------------------------------------------------------------------------------------------------
# Field types: pydantic's validation, its failures in this server's words


def _refusal(message: str) -> PydanticCustomError:
  return PydanticCustomError("specjax_invalid", message)      # no context: the message is kept verbatim


def _explained(say: Say) -> WrapValidator:
  """Pydantic's validation of the declared type and constraints, a failure reworded by ``say``."""
  def check(value, handler, info: ValidationInfo):
    try:
      return handler(value)
    except ValidationError as e:
      raise _refusal(say(info.field_name, value, e.errors()[0]["type"])) from None
  return WrapValidator(check)


def _always(message: str) -> WrapValidator:
  return _explained(lambda name, value, error: message)


def _number_say(kind: type, lo, hi) -> Say:
  def say(name, value, error):
    if error not in _RANGE_ERRORS:
      return f"'{name}' must be a{'n integer' if kind is int else ' number'}, got {value!r}"
    try:
      value = kind(value)
    except OverflowError:
      pass
    return f"'{name}' must be in [{lo}, {hi}], got {value}"
  return say


def _whole_to_int(value):
  """A float with no fractional part counts as an integer (3.0 → 3): JSON does not tell them apart."""
  return int(value) if isinstance(value, float) and value.is_integer() else value


def _int(lo, hi=None):
  """An optional integer (never a bool, a string or 2.5) in [lo, hi]; null: the server's default."""
  return Annotated[StrictInt | None, Field(ge=lo, le=hi), BeforeValidator(_whole_to_int),
                   _explained(_number_say(int, lo, hi))]


def _float(lo, hi):
  """An optional number (an int or a float, never a bool or a string) in [lo, hi]; null: the server's default."""
  return Annotated[StrictFloat | None, Field(ge=lo, le=hi), _explained(_number_say(float, lo, hi))]


def _top_p_say(name, value, error):
  if error in _RANGE_ERRORS and value == 0:
    return "'top_p' must be in (0, 1] (1 keeps every token), got 0"
  return _number_say(float, 0.0, 1.0)(name, value, error)


def _no_effect(value, info: ValidationInfo):
  if value not in (NEUTRAL[info.field_name], None):
    raise _refusal(f"'{info.field_name}' = {value!r} is not supported by this server (leave it unset)")
  return value


def _no_alternatives(value):
  if value not in (0, None):
    raise _refusal(f"'top_logprobs' = {value!r}: top alternatives are not offered; leave it unset or 0 (the "
                   "chosen tokens' log-probabilities come with logprobs)")
  return value


MaxTokens = _int(1)
Temperature = _float(0.0, 2.0)
TopP = Annotated[StrictFloat | None, Field(gt=0.0, le=1.0), _explained(_top_p_say)]
TopK = _int(-1)              # -1 or 0: no top-k filter
Seed = Annotated[StrictInt | None, Field(ge=0, lt=2 ** 63),
                 _explained(lambda name, value, error: f"'seed' must be an integer in [0, 2^63), got {value!r}")]
Stop = Annotated[Union[StrictStr, Annotated[list[StrictStr], Field(max_length=4)], None],
                 _always("'stop' must be a string or a list of up to 4 strings")]
Stream = Annotated[StrictBool, _always("'stream' must be true or false")]
NoEffect = Annotated[Any, AfterValidator(_no_effect),
                     Field(description="not supported: accepted only at its no-effect value (listed) or null")]
TopLogprobs = Annotated[Any, AfterValidator(_no_alternatives),
                        Field(description="0 or null: top alternatives are not offered")]
Speculation = Annotated[
    StrictStr | None,
    Field(max_length=200, description="specjax: this request's own speculation: off, k=N (a chain the server "
          "compiled) or a tree spec it was started with (--tree), e.g. branch:2,2,1; null: its policy decides"),
    _always("'speculation' must be a string of up to 200 characters: off, k=N or a tree spec such as "
            "branch:2,2,1 (or null: the server's policy decides)")]
Echoed = Annotated[Any, Field(description="echoed back in the response (default: the served model's name)")]
Ignored = SkipJsonSchema[Any]      # accepted (the other endpoint's field), not used


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="allow")
  include_usage: Any = Field(False, description="truthy: a last chunk carries the usage")


class ChatMessage(BaseModel):
  model_config = ConfigDict(extra="allow")
  role: StrictStr
  content: StrictStr


NonEmpty = Annotated[StrictStr, Field(min_length=1)]
Prompt = Annotated[Union[NonEmpty, Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]],
                   AfterValidator(lambda p: p[0] if isinstance(p, list) else p),
                   _always("'prompt' must be a non-empty string")]
Messages = Annotated[list[ChatMessage], Field(min_length=1),
                     _always("'messages' must be a non-empty list of {role, content} objects with string "
                             "content")]
# Falsy (null, {}, 0, "", …) means no options, as before; anything else must be an object.
StreamOptionsField = Annotated[StreamOptions | None, _always("'stream_options' must be an object"),
                               BeforeValidator(lambda v: v or None)]


# ----------------------------------------------------------------------------------------------------------
# The request models


def _neutral_values(schema: dict) -> None:
  """The JSON schema of a request: each unsupported field lists the values it is accepted at."""
  for name, neutral in NEUTRAL.items():
    schema["properties"][name]["enum"] = [neutral] if neutral is None else [neutral, None]


class _OpenAIRequest(BaseModel):
  """The fields both endpoints share."""
  model_config = ConfigDict(extra="forbid", json_schema_extra=_neutral_values)

  model: Echoed = None
  max_tokens: MaxTokens = None
  max_completion_tokens: MaxTokens = Field(None, description="OpenAI's newer name: wins over max_tokens")
  temperature: Temperature = None
  top_p: TopP = None
  top_k: TopK = None
  seed: Seed = None
  stop: Stop = None
  stream: Stream = False
  stream_options: StreamOptionsField = None
  top_logprobs: TopLogprobs = None
  user: Annotated[Any, Field(description="accepted, not used")] = None
  n: NoEffect = None
  presence_penalty: NoEffect = None
  frequency_penalty: NoEffect = None
  echo: NoEffect = None
  best_of: NoEffect = None
  suffix: NoEffect = None
  logit_bias: NoEffect = None
  response_format: NoEffect = None
  tools: NoEffect = None
  tool_choice: NoEffect = None
  parallel_tool_calls: NoEffect = None
  speculation: Speculation = None

  @model_validator(mode="before")
  @classmethod
  def _prepare(cls, data):
    """A required field that is absent is judged as null (so that it gets its own message), and with
    ``max_completion_tokens`` present ``max_tokens`` is not looked at."""
    if not isinstance(data, dict):
      return data
    data = {**{name: None for name, f in cls.model_fields.items() if f.is_required()}, **data}
    if "max_completion_tokens" in data:
      data.pop("max_tokens", None)
    return data

  def _prompt(self):
    raise NotImplementedError

  def _wants_logprobs(self) -> bool:
    raise NotImplementedError

  def submission(self, server_sp: sampling.SamplingParams, default_max_tokens: int) -> dict:
    """What the server submits: the prompt, the limits, the sampling settings (a field left unset or null takes
    the server's default), the stop strings and the streaming options."""
    newer = "max_completion_tokens" in self.model_fields_set
    max_tokens = self.max_completion_tokens if newer else self.max_tokens
    temperature = server_sp.temperature if self.temperature is None else self.temperature
    top_p = server_sp.top_p if self.top_p is None else self.top_p
    top_k = server_sp.top_k if self.top_k is None else self.top_k
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    return {"prompt": self._prompt(), "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "stops": [s for s in stops if s], "stream": self.stream, "model": self.model,
            "include_usage": bool(self.stream_options and self.stream_options.include_usage),
            "sampling": sampling.SamplingParams(temperature, max(top_k, 0), top_p),
            "seed": self.seed, "logprobs": self._wants_logprobs(), "speculation": self.speculation}


class CompletionRequest(_OpenAIRequest):
  """``POST /v1/completions``: a prompt string (or a list of exactly one)."""
  prompt: Prompt
  logprobs: Annotated[StrictInt | None, Field(ge=0, le=0, description="0: the chosen tokens' log-probabilities"),
                      _explained(lambda name, value, error: (
                          f"'logprobs' = {value!r}: this server returns the chosen tokens' log-probabilities "
                          "(logprobs: 0), not top alternatives"))] = None
  messages: Ignored = None

  def _prompt(self) -> str:
    return self.prompt

  def _wants_logprobs(self) -> bool:
    return self.logprobs is not None


class ChatCompletionRequest(_OpenAIRequest):
  """``POST /v1/chat/completions``: a conversation, rendered with the model's chat template."""
  messages: Messages
  logprobs: Annotated[StrictBool | None, Field(description="the chosen tokens' log-probabilities"),
                      _explained(lambda name, value, error: (
                          f"'logprobs' must be true or false for chat completions, got {value!r}"))] = None
  prompt: Ignored = None

  def _prompt(self) -> list[dict]:
    return [m.model_dump() for m in self.messages]

  def _wants_logprobs(self) -> bool:
    return bool(self.logprobs)


KNOWN_FIELDS = set(ChatCompletionRequest.model_fields)
assert KNOWN_FIELDS == set(CompletionRequest.model_fields)


# ----------------------------------------------------------------------------------------------------------
# Parsing


def bad_request(e: ValidationError) -> BadRequest:
  """A pydantic failure as this server reports it: every unknown field, or else the first bad field."""
  errors = e.errors()
  unknown = sorted(str(err["loc"][0]) for err in errors if err["type"] == "extra_forbidden")
  if unknown:
    return BadRequest(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])

  def rank(err):
    name = err["loc"][0] if err["loc"] else None
    return CHECK_ORDER.index(name) if name in CHECK_ORDER else len(CHECK_ORDER)
  first = min(errors, key=rank)
  return BadRequest(first["msg"], param=str(first["loc"][0]) if first["loc"] else None)


def parse_request(body: Any, chat: bool, server_sp, default_max_tokens: int) -> dict:
  """Validate an OpenAI request body (a chat or a completions one) into the server's submission."""
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object")
  try:
    request = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
  except ValidationError as e:
    raise bad_request(e) from None
  return request.submission(server_sp, default_max_tokens)


def openapi_schemas(ref_prefix: str = "#/components/schemas/") -> dict[str, dict]:
  """The request models' JSON schemas (and those they refer to), by name, their references under
  ``ref_prefix``: what an OpenAPI document's components hold."""
  _, top = models_json_schema([(m, "validation") for m in (CompletionRequest, ChatCompletionRequest)],
                              ref_template=ref_prefix + "{model}")
  return top["$defs"]
