"""Output constraints (constrained decoding): what a request may generate, as a token mask per step.

A request's `OutputConstraint` (JSON Schema, any JSON object, a regex, or DeepSeek-V4.1 DSML tool
calls) is compiled by llguidance into a grammar; the scheduler keeps one `ConstraintMatcher` per
constrained sequence, fills the packed mask row of the next token on the host before each engine call,
and feeds every sampled token back. The engine applies the mask inside its compiled sampler
(`ced_jax.sampling.apply_token_bitmask`): i32[W] per row, W = ceil(vocab_size / 32), bit j of word w
set <=> token 32 w + j allowed, all ones = unconstrained (llguidance's own layout, written in place).

Why llguidance (not xgrammar): its wheel is abi3 with no runtime dependencies, while xgrammar pulls in
torch, transformers and triton, heavy for a JAX image; it compiles JSON Schema, regexes and Lark
grammars (with `%json{...}` sub-schemas and special tokens by id, which the DSML tool-call grammar
needs) lazily, so a new schema costs no up-front automaton build; and it writes the same packed mask
xgrammar would. xgrammar's ready-made V4.1 structural tag is replaced by the Lark grammar below.

Formats (`/work/shared/spec/api-surface.md` §7, §8, §16.5):
- JSON (`json_schema`, `json_object`) is generated compactly, with `", "` and `": "` separators (as
  `json.dumps` writes and the model was trained on) and no other whitespace, so a grammar cannot be
  padded forever with blanks. `json_object` is any JSON object.
- Tool calls continue a prompt that already ends with `\\n\\n<｜DSML｜ calls>\\n` (the encoder pre-fills
  it for `tool_choice` required / named): one or more `<｜DSML｜ invoke name="NAME">\\n` + parameters +
  `</｜DSML｜ invoke>\\n`, then `</｜DSML｜ calls>`, then EOS.
  A parameter is `<｜DSML｜ parameter name="P" string="true|false">VALUE</｜DSML｜ parameter>\\n`, in
  the order of the schema's `properties`, required ones always present. A property whose schema says
  `"type": "string"` is raw text (`string="true"`, no `<`, honouring `enum` / `const` / `pattern` /
  `minLength` / `maxLength`); any other is JSON matching the property's sub-schema (`string="false"`).
  `｜DSML｜` is a special token, referred to by id (`<[id]>` in llguidance's Lark).

Errors: a constraint that cannot be compiled raises `ConstraintError` naming the field, when the
request is validated, never inside the engine loop.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from re import _constants as _sre  # Python's own regex parser: its tree gives the repeat counts
from re import _parser as _sre_parser
from typing import Any, Literal

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

from serving.errors import InvalidRequest
from serving.json_limits import MAX_NESTING, nesting_depth

KINDS = ("json_schema", "json_object", "regex", "tool_calls")
DSML_TOKEN = "｜DSML｜"
THINK_END_TOKEN = "</think>"
# Compact JSON, no free whitespace (see the module docstring).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance builds a counted repetition's expansion lazily, when the output reaches it; past about
# 250,000 positions (measured: a{249413} runs, a{250292} and (ab){200000} fail) it stops with "too many
# expressions constructed" in the middle of a stream. Regexes are refused at submission past this.
MAX_REGEX_EXPANSION = 100_000
MAX_TOOLS = 128  # OpenAI's limit; thousands of tools also overflow llguidance's grammar tables
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class ConstraintError(ValueError):
    """A constraint that cannot be enforced; `field` names the part of `OutputConstraint` at fault
    (`json_schema`, `regex`, `tools[1].function.parameters`, `tool_name`, ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputConstraint:
    """What a request may generate. Structural checks run here; the grammar is compiled (and checked)
    against the model's tokenizer by `ConstraintTokenizer.matcher`.

    kind "json_schema": `json_schema` (a JSON Schema object); "json_object": any JSON object;
    "regex": `regex` (the whole output matches it); "tool_calls": `tools` (OpenAI function tools,
    `{"type": "function", "function": {"name", "description", "parameters"}}`), restricted to
    `tool_name` when set (a named `tool_choice`; None = any of them, `required`), one call only unless
    `parallel_tool_calls`, then at most `max_tool_calls` (None = no limit; the Responses API's
    `max_tool_calls`).
    start_after_token: the constraint starts after this token has been generated (thinking mode:
    the id of `</think>`); until then rows are unconstrained except that the output may not end
    (EOS is masked), so the constrained part always comes. None = from the first token.
    """

    kind: Literal["json_schema", "json_object", "regex", "tool_calls"]
    json_schema: Mapping[str, Any] | None = None
    regex: str | None = None
    tools: Sequence[Mapping[str, Any]] = ()
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    start_after_token: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError("kind", f"must be one of {', '.join(KINDS)}, got {self.kind!r}")
        expected = {"json_schema": "json_schema", "regex": "regex", "tool_calls": "tools"}.get(self.kind)
        for name in ("json_schema", "regex", "tools"):
            given = bool(getattr(self, name)) if name == "tools" else getattr(self, name) is not None
            if given and name != expected:
                raise ConstraintError(name, f"is not used by kind {self.kind!r}")
        if self.tool_name is not None and self.kind != "tool_calls":
            raise ConstraintError("tool_name", f"is not used by kind {self.kind!r}")
        if self.max_tool_calls is not None and not 1 <= self.max_tool_calls <= 128:
            raise ConstraintError("max_tool_calls", f"must be in 1..128, got {self.max_tool_calls}")
        if self.start_after_token is not None and self.start_after_token < 0:
            raise ConstraintError(
                "start_after_token", f"must be a token id >= 0, got {self.start_after_token}"
            )
        if self.kind == "json_schema":
            if not isinstance(self.json_schema, Mapping):
                raise ConstraintError("json_schema", "must be a JSON Schema object")
            _check_schema_patterns("json_schema", self.json_schema)
            _check_grammar("json_schema", _json_grammar(self.json_schema))
        elif self.kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ConstraintError("regex", "must be a non-empty regular expression")
            _check_regex_size("regex", self.regex)
            _check_grammar("regex", llg.LLMatcher.grammar_from_regex(self.regex))
        elif self.kind == "tool_calls":
            object.__setattr__(self, "tools", tuple(self.tools))
            self.selected_tools()  # checks the tools and tool_name

    @classmethod
    def from_recipe(
        cls,
        kind: str,
        schema: str,
        *,
        start_after_token: int | None = None,
        parallel_tool_calls: bool = True,
        max_tool_calls: int | None = None,
    ) -> OutputConstraint | None:
        """The constraint for deepseek-recipe's `InferenceOptions.output_constraint` (kind, schema):
        `json` with "" is `json_object`, with a schema `json_schema`; `regex`; `tool_call_required`
        (the tool list as a JSON array; one tool for a named choice) is `tool_calls`. `tool_call`
        (`tool_choice` auto: text or calls, the model decides) is not constrained: None.
        parallel_tool_calls / max_tool_calls (the request's, if any) bound the number of calls."""
        if kind == "json":
            if not schema:
                return cls(kind="json_object", start_after_token=start_after_token)
            return cls(
                kind="json_schema",
                json_schema=_json_text("json_schema", schema),
                start_after_token=start_after_token,
            )
        if kind == "regex":
            return cls(kind="regex", regex=schema, start_after_token=start_after_token)
        if kind == "tool_call_required":
            return cls(
                kind="tool_calls",
                tools=_json_text("tools", schema, list),
                parallel_tool_calls=parallel_tool_calls,
                max_tool_calls=max_tool_calls,
                start_after_token=start_after_token,
            )
        if kind == "tool_call":
            return None
        raise ConstraintError("kind", f"unknown output constraint kind {kind!r}")

    def _max_calls(self) -> int | None:
        return 1 if not self.parallel_tool_calls else self.max_tool_calls

    def selected_tools(self) -> list[tuple[int, str, Mapping[str, Any]]]:
        """(index in `tools`, name, parameters schema) of the tools a call may use."""
        if not self.tools:
            raise ConstraintError("tools", "at least one function tool is required")
        if len(self.tools) > MAX_TOOLS:
            raise ConstraintError(
                "tools", f"at most {MAX_TOOLS} tools (as OpenAI's API), got {len(self.tools)}"
            )
        out = []
        for i, tool in enumerate(self.tools):
            where = f"tools[{i}]"
            if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
                raise ConstraintError(where, 'must be {"type": "function", "function": {...}}')
            fn = tool.get("function")
            if not isinstance(fn, Mapping):
                raise ConstraintError(f"{where}.function", "must be an object")
            name = fn.get("name")
            if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
                raise ConstraintError(
                    f"{where}.function.name", f"must match {_TOOL_NAME.pattern}, got {name!r}"
                )
            params = fn.get("parameters", {"type": "object", "properties": {}})
            _check_parameters(f"{where}.function.parameters", params)
            out.append((i, name, params))
        if self.tool_name is not None:
            out = [t for t in out if t[1] == self.tool_name]
            if not out:
                raise ConstraintError("tool_name", f"{self.tool_name!r} is not one of the tools")
        return out

    def grammar(self, dsml_token_id: int | None) -> str:
        """The llguidance grammar (a Lark grammar or a compiled JSON/regex one)."""
        if self.kind == "json_schema":
            return _json_grammar(self.json_schema)
        if self.kind == "json_object":
            return _json_grammar({"type": "object"})
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.regex)
        if dsml_token_id is None:
            raise ConstraintError("tools", f"the tokenizer has no {DSML_TOKEN} token for tool calls")
        return llg.LLMatcher.grammar_from_lark(
            _tool_calls_lark(self.selected_tools(), dsml_token_id, self._max_calls())
        )


def _json_grammar(schema: Mapping[str, Any]) -> str:
    try:
        return llg.LLMatcher.grammar_from_json_schema(dict(schema), overrides=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise ConstraintError("json_schema", f"not a JSON object: {e}") from None


def _check_grammar(field: str, grammar: str, tokenizer: llg.LLTokenizer | None = None) -> None:
    error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ConstraintError(field, _first_line(error))


def _check_regex_size(field: str, regex: str) -> None:
    size = _regex_expansion(regex)
    if size > MAX_REGEX_EXPANSION:
        raise ConstraintError(
            field,
            f"a match spells out at least {size} characters (counted repetitions expanded); "
            f"the limit is {MAX_REGEX_EXPANSION}",
        )


def _regex_expansion(regex: str) -> int:
    """The characters a match must spell out through counted repetitions (each repeat's lower count
    times its body's; alternatives count their largest). Python's parser reads the common syntax;
    where it cannot (Rust-only escapes such as \\p{L}), the largest single count is taken."""
    try:
        parsed = _sre_parser.parse(regex)
    except (re.error, RecursionError, OverflowError):
        return max((int(m) for m in re.findall(r"(?<!\\)\{(\d{1,12})(?:,\d*)?\}", regex)), default=0)
    return _expansion(parsed)


def _expansion(items) -> int:
    total = 0
    for op, arg in items:
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
            low, _, body = arg
            total += low * _expansion(body)
        elif op is _sre.SUBPATTERN:
            total += _expansion(arg[-1])
        elif op is _sre.BRANCH:
            total += max((_expansion(b) for b in arg[1]), default=0)
        elif op in (_sre.ATOMIC_GROUP, _sre.ASSERT, _sre.ASSERT_NOT):
            total += _expansion(arg if op is _sre.ATOMIC_GROUP else arg[1])
        elif op in (_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.RANGE, _sre.CATEGORY):
            total += 1
    return total


def _check_schema_patterns(field: str, schema: Any, depth: int = 0) -> None:
    """Every `pattern` (and `patternProperties` key) of a JSON Schema, held to the regex limit."""
    if depth > MAX_NESTING:
        return  # deeper schemas are refused by the nesting check
    if isinstance(schema, Mapping):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                _check_regex_size(f"{field}.pattern", value)
            elif key == "patternProperties" and isinstance(value, Mapping):
                for name in value:
                    _check_regex_size(f"{field}.patternProperties", str(name))
            _check_schema_patterns(field, value, depth + 1)
    elif isinstance(schema, list):
        for value in schema:
            _check_schema_patterns(field, value, depth + 1)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _check_parameters(field: str, params: Any) -> None:
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise ConstraintError(field, 'must be a JSON Schema with "type": "object"')
    props = params.get("properties", {})
    if not isinstance(props, Mapping):
        raise ConstraintError(f"{field}.properties", "must be an object")
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise ConstraintError(f"{field}.required", "must list names of properties")
    for name, sub in props.items():
        if not name or any(c in name for c in '"<\n'):
            raise ConstraintError(f"{field}.properties", f"parameter name {name!r} cannot be written in DSML")
        if not isinstance(sub, Mapping):
            raise ConstraintError(f"{field}.properties.{name}", "must be a JSON Schema object")
        _check_schema_patterns(f"{field}.properties.{name}", sub)
        if not _is_raw_string(sub):
            _check_grammar(f"{field}.properties.{name}", _json_grammar(_sub_schema(sub, params)))
        elif "pattern" in sub:
            _check_grammar(
                f"{field}.properties.{name}",
                llg.LLMatcher.grammar_from_lark(f"start: {_raw_string_lark(sub)}"),
            )


def _is_raw_string(schema: Mapping[str, Any]) -> bool:
    """DSML writes a `"type": "string"` value as raw text (string="true"), anything else as JSON."""
    return schema.get("type") == "string"


def _sub_schema(sub: Mapping[str, Any], params: Mapping[str, Any]) -> dict:
    """A property's schema as a schema of its own: the parameters' `$defs` / `definitions` come along
    (so `#/$defs/...` references still resolve) and so do the compact-JSON options."""
    out = dict(sub)
    for key in ("$defs", "definitions"):
        if key in params and key not in out:
            out[key] = params[key]
    return out


def _raw_string_lark(schema: Mapping[str, Any]) -> str:
    """A Lark expression for a raw (string="true") value under its string schema. Values never contain
    `<`, so the closing `</｜DSML｜ parameter>` is unambiguous (a `pattern` is taken as it is, anchored)."""
    if "const" in schema:
        return _lit(str(schema["const"]))
    if "enum" in schema:
        return "(" + " | ".join(_lit(str(v)) for v in schema["enum"]) + ")"
    if "pattern" in schema:
        return "/" + str(schema["pattern"]).replace("/", "\\/") + "/"
    lo = int(schema.get("minLength", 0))
    hi = schema.get("maxLength")
    return f"/[^<]{{{lo},{'' if hi is None else int(hi)}}}/"


def _lit(text: str) -> str:
    """A Lark string literal (JSON escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _tool_calls_lark(tools, dsml: int, max_calls: int | None) -> str:
    d = f"<[{dsml}]>"
    calls = "call+" if max_calls is None else " ".join(["call"] + ["call?"] * (max_calls - 1))
    lines = [f'start: {calls} "</" {d} " calls>"']
    lines.append("call: " + " | ".join(f"call_{i}" for i, _, _ in tools))
    for i, name, params in tools:
        props = params.get("properties", {})
        required = set(params.get("required", []))
        parts = []
        for j, (pname, sub) in enumerate(props.items()):
            rule = f"p_{i}_{j}"
            raw = _is_raw_string(sub)
            value = _raw_string_lark(sub) if raw else "%json" + json.dumps(_sub_schema(sub, params) | {
                "x-guidance": _JSON_OPTIONS
            })  # fmt: skip
            head = f' parameter name="{pname}" string="{"true" if raw else "false"}">'
            lines.append(f'{rule}: "<" {d} {_lit(head)} {value} "</" {d} " parameter>\\n"')
            parts.append(rule if pname in required else f"{rule}?")
        invoke = f' invoke name="{name}">\n'
        lines.append(f'call_{i}: "<" {d} {_lit(invoke)} {" ".join(parts)} "</" {d} " invoke>\\n"')
    return "\n".join(lines) + "\n"


class ConstraintTokenizer:
    """llguidance's view of the model's tokenizer (built once per server from tokenizer.json), and
    the factory of per-request matchers."""

    def __init__(self, tokenizer_json: str | Path, *, vocab_size: int, eos_token_ids: Sequence[int]):
        path = Path(tokenizer_json)
        added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens", [])
        self.special_ids = {t["content"]: int(t["id"]) for t in added}
        # n_vocab = the model's vocabulary, so a mask row has exactly the engine's W words (ids the
        # tokenizer does not have are never allowed).
        self.lltok = llg.LLTokenizer(str(path), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        # The mask before a constraint's start token: anything but EOS (the constrained part must come).
        words = np.full(self.words, 0xFFFFFFFF, np.uint32)
        for t in eos_token_ids:
            if 0 <= t < vocab_size:
                words[t >> 5] &= ~np.uint32(1 << (t & 31))
        self.before_start = words.view(np.int32)
        # Fills the rows of one step on several threads, without the GIL (llguidance's own pool).
        self._executor = llg.LLExecutor()

    def fill_masks(self, rows: Sequence[tuple[ConstraintMatcher, int]], bitmask: np.ndarray) -> None:
        """Writes each matcher's next-token mask into its row of `bitmask` (i32[S, W], C order), all
        rows in one parallel call (`ConstraintMatcher.fill`, batched)."""
        if bitmask.shape[1] != self.words or not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError(f"bitmask must be a C-ordered [S, {self.words}] array, got {bitmask.shape}")
        active = []
        for m, r in rows:
            if m.active:
                active.append((m._m, r))
            else:
                bitmask[r] = m.before_start
        if active:
            llg_np.fill_next_token_bitmask_par(self._executor, active, bitmask)

    def token_id(self, text: str) -> int | None:
        """The id of an added (special) token, e.g. `</think>`; None if the tokenizer has none."""
        return self.special_ids.get(text)

    def matcher(self, constraint: OutputConstraint) -> ConstraintMatcher:
        """A fresh matcher for one request; ConstraintError (naming the field) if it cannot be built."""
        if constraint.start_after_token is not None and constraint.start_after_token >= self.vocab_size:
            raise ConstraintError("start_after_token", f"must be a token id < {self.vocab_size}")
        grammar = constraint.grammar(self.token_id(DSML_TOKEN))
        field = {"tool_calls": "tools", "json_object": "kind"}.get(constraint.kind, constraint.kind)
        _check_grammar(field, grammar, self.lltok)
        m = llg.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise ConstraintError(field, _first_line(m.get_error()))
        return ConstraintMatcher(m, constraint.start_after_token, self.before_start)


class ConstraintMatcher:
    """The grammar state of one sequence. `fill(row)` writes the mask of the next token; `consume`
    advances past a sampled token. Before `start_after_token` has been generated the mask is
    `before_start` (all ones but EOS; default all ones) and tokens are not fed to the grammar (the
    token itself is not part of the constrained output)."""

    def __init__(self, matcher: llg.LLMatcher, start_after_token: int | None, before_start=None):
        self._m = matcher
        self._start = start_after_token
        self.active = start_after_token is None
        self.before_start = np.int32(-1) if before_start is None else before_start

    def fill(self, row: np.ndarray) -> None:
        """row: i32[W], written in place (`before_start` while inactive)."""
        if not self.active:
            row[:] = self.before_start
            return
        llg_np.fill_next_token_bitmask(self._m, row.reshape(1, -1), 0)

    def fill_draft_masks(self, drafts, rows: np.ndarray) -> int:
        """Speculative decoding: writes the masks of the next token and of the token after each
        draft the grammar allows (rows: i32[len(drafts) + 1, W], row j = the mask after drafts
        0..j-1), stopping at the first draft it forbids; returns how many drafts it allows. The
        matcher is left as it was (advanced through the drafts, then rolled back)."""
        active, fed = self.active, 0
        allowed = 0
        try:
            for j, d in enumerate(drafts):
                self.fill(rows[j])
                d = int(d)
                if not (int(rows[j, d >> 5]) >> (d & 31)) & 1:
                    break
                if not self.active:
                    self.active = d == self._start
                else:
                    self._m.consume_token(d)
                    fed += 1
                    if self._m.is_error():
                        break
                allowed = j + 1
            else:
                self.fill(rows[len(drafts)])
            if allowed < len(drafts) or self._m.is_error():
                rows[allowed + 1 :] = -1  # not verified: any value will do
        finally:
            if fed:
                self._m.rollback(fed)
            self.active = active
        return allowed

    def consume(self, token_id: int) -> None:
        """Feeds a sampled token; afterwards check `error` and `done`."""
        if not self.active:
            self.active = token_id == self._start
            return
        self._m.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow (or EOS was consumed)."""
        return self.active and not self._m.is_error() and self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.active and self._m.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the grammar cannot continue (a token it does not allow, a resource limit); None if fine."""
        return _first_line(self._m.get_error()) if self._m.is_error() else None


def constraint_from_proto(message) -> OutputConstraint | None:
    """The `OutputConstraint` of a gRPC `GenerateRequest.constraint` (None when unset); raises
    `serving.errors.InvalidRequest` naming the proto field (`constraint.json_schema`, ...)."""
    if not message.HasField("constraint"):
        return None
    c = message.constraint
    which = c.WhichOneof("kind")
    after = c.start_after_token if c.HasField("start_after_token") else None
    try:
        if which is None:
            raise ConstraintError("kind", "one of json_schema, json_object, regex or tool_calls is required")
        if which == "json_schema":
            return OutputConstraint(
                kind="json_schema",
                json_schema=_json_text("json_schema", c.json_schema),
                start_after_token=after,
            )
        if which == "json_object":
            if not c.json_object:
                raise ConstraintError("json_object", "must be true when set")
            return OutputConstraint(kind="json_object", start_after_token=after)
        if which == "regex":
            return OutputConstraint(kind="regex", regex=c.regex, start_after_token=after)
        tc = c.tool_calls
        tools = _json_text("tool_calls.tools_json", tc.tools_json, list)
        try:
            return OutputConstraint(
                kind="tool_calls",
                tools=tools,
                tool_name=tc.name if tc.HasField("name") else None,
                parallel_tool_calls=tc.parallel_tool_calls if tc.HasField("parallel_tool_calls") else True,
                max_tool_calls=tc.max_tool_calls if tc.HasField("max_tool_calls") else None,
                start_after_token=after,
            )
        except ConstraintError as e:
            field = (
                e.field.replace("tools", "tool_calls.tools_json", 1)
                if e.field.startswith("tools")
                else e.field
            )
            field = {"tool_name": "tool_calls.name", "max_tool_calls": "tool_calls.max_tool_calls"}.get(
                field, field
            )
            raise ConstraintError(field, e.message) from None
    except ConstraintError as e:
        raise InvalidRequest(f"constraint.{e.field}", e.message) from None


def _json_text(field: str, text: str, kind: type = dict):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstraintError(field, f"not valid JSON: {e}") from None
    except RecursionError:  # nested past Python's own limit: certainly past ours
        raise ConstraintError(field, f"nested deeper than {MAX_NESTING} levels") from None
    if nesting_depth(value) > MAX_NESTING:
        raise ConstraintError(field, f"nested deeper than {MAX_NESTING} levels")
    if not isinstance(value, kind):
        raise ConstraintError(field, f"must be a JSON {'object' if kind is dict else 'array'}")
    return value
