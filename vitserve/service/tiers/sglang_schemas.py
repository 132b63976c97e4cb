"""The bodies SGLang sends this tier (docs/sglang.md): `POST /encode` (`EncodeCall`, one part of a request) and
`POST /scheduler_receive_url` (`Registration`, one receiver of a part), with their bounds.

Each string field's bound is its schema's `max_length`, the one source of it: pydantic checks it on the body as read,
and `bounded` checks it again once read_json has restored the body's long strings (it validates the body with each
string of over 4 KB standing as a short placeholder)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from ..ground.errors import InputRejected

MAX_RECEIVERS = 256  # receive_count, and an embedding_port list: the language server's tensor-parallel size
MAX_REQ_ID = 512  # characters of a req_id
MAX_HOST = 253  # characters of a host name (DNS's limit)


def _item(value):
    return {"url": value} if isinstance(value, str) else value


class EncodeCallItem(BaseModel):
    """One of a part's `mm_items`: a data URI, base64 or an http(s) URL (a bare string in the request stands for
    `{"url": it}`). The per-medium options SGLang sends beside it (`detail`, `content_hash`, `preprocess_kwargs`,
    ...) are accepted and not applied: this server preprocesses with its own settings, and SGLang sizes the prompt
    from the grids it is sent."""

    model_config = ConfigDict(extra="allow")
    url: str


Port = Annotated[StrictInt, Field(ge=1, le=65535)]


class EncodeCall(BaseModel):
    """The body of `POST /encode`, as SGLang's language side (`MMReceiverHTTP.encode`) sends it and its encoder
    checks it (`validate_encode_request`); the fields only SGLang reads (`encoder_idx`, `encoder_url`,
    `time_stats_json`, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    req_id: str = Field(min_length=1, max_length=MAX_REQ_ID)
    num_parts: StrictInt = Field(gt=0)
    part_idx: StrictInt = Field(ge=0)
    modality: Annotated[Literal["IMAGE", "VIDEO"], BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v)]
    mm_items: list[Annotated[EncodeCallItem, BeforeValidator(_item)]] = Field(min_length=1)
    prefill_host: str | None = Field(default=None, max_length=MAX_HOST)
    embedding_port: Port | Annotated[list[Port], Field(min_length=1, max_length=MAX_RECEIVERS)] | None = None
    # (null: the receivers register, zmq_to_scheduler)

    @model_validator(mode="after")
    def _consistent(self):
        if self.part_idx >= self.num_parts:
            raise ValueError(f"part_idx must be in [0, {self.num_parts})")
        if self.embedding_port is not None and not self.prefill_host:
            raise ValueError("an embedding_port needs the prefill_host it is on")
        return self

    @property
    def kind(self) -> str:
        """The part's modality as this server names it: image or video."""
        return self.modality.lower()


class Registration(BaseModel):
    """The body of `POST /scheduler_receive_url`: one receiver of part `req_id` (`host:port`, an IPv6 host in
    brackets), and how many receivers the part has."""

    model_config = ConfigDict(extra="allow")
    req_id: str = Field(min_length=1, max_length=MAX_REQ_ID)
    receive_count: StrictInt = Field(gt=0, le=MAX_RECEIVERS)
    receive_url: str = Field(max_length=300)
    modality: str | None = Field(default=None, max_length=16)


def string_limits(model: type[BaseModel]) -> dict[str, int]:
    """The `max_length` of each of `model`'s fields that has one, in the fields' order: the bounds `bounded` checks.
    (A field whose value must be one of a few words, as /encode's `modality`, needs none: no placeholder is one.)"""
    return {
        name: bound.max_length
        for name, field in model.model_fields.items()
        for bound in field.metadata
        if getattr(bound, "max_length", None) is not None
    }


CALL_LIMITS = string_limits(EncodeCall)
REGISTRATION_LIMITS = string_limits(Registration)


def bounded(body: BaseModel, limits: dict[str, int] | None = None) -> None:
    """A body's string fields within their lengths (`limits`; by default its schema's `string_limits`) once its long
    strings are restored (read_json validates the body with each string of over 4 KB standing as a short
    placeholder): a 400 naming the field, not echoing it."""
    for name, limit in (string_limits(type(body)) if limits is None else limits).items():
        value = getattr(body, name)
        if isinstance(value, str) and len(value) > limit:
            raise InputRejected(f"{name}: at most {limit} characters, got {len(value)}", "invalid_request", name)
