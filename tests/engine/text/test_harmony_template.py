"""gpt-oss's Harmony chat format renders through the bounded sandbox exactly as transformers
renders it. HARMONY is written for this test with the structure of the template gpt-oss
publishes (chat_template.jinja): a system message with the model identity, knowledge cutoff,
today's date (strftime_now) and reasoning effort; a developer message from a leading
system/developer message plus the tools, each rendered as a TypeScript signature by a
recursive macro; assistant turns on the analysis/commentary/final channels, a tool call's
arguments as JSON, raise_exception for channel tags in content, namespace() state across
the loop and slices of the conversation by loop.index."""

from __future__ import annotations

import pytest

HARMONY_SPECIALS = ["<|startoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>", "<|call|>",
                    "<|constrain|>"]

HARMONY = r"""
{%- macro ts_type(spec) -%}
    {%- if spec.type == "array" -%}
        {%- if spec['items'] is defined -%}{{- ts_type(spec['items']) + "[]" -}}{%- else -%}{{- "any[]" -}}{%- endif -%}
    {%- elif spec.type is defined and spec.type is iterable and spec.type is not string and spec.type is not mapping -%}
        {{- spec.type | join(" | ") -}}
    {%- elif spec.type == "string" -%}
        {%- if spec.enum -%}{{- '"' + spec.enum | join('" | "') + '"' -}}{%- else -%}{{- "string" -}}{%- endif -%}
    {%- elif spec.type in ["number", "integer"] -%}{{- "number" -}}
    {%- elif spec.type == "boolean" -%}{{- "boolean" -}}
    {%- elif spec.type == "object" and spec.properties -%}
        {{- "{\n" -}}
        {%- for name, inner in spec.properties.items() -%}
            {{- name -}}{%- if name not in (spec.required or []) -%}{{- "?" -}}{%- endif -%}
            {{- ": " + ts_type(inner) -}}{%- if not loop.last -%}{{- ", " -}}{%- endif -%}
        {%- endfor -%}
        {{- "}" -}}
    {%- else -%}{{- "any" -}}
    {%- endif -%}
{%- endmacro -%}

{%- macro functions_namespace(tools) -%}
    {{- "## functions\n\nnamespace functions {\n\n" -}}
    {%- for tool in tools -%}
        {%- set fn = tool.function if tool.function is defined else tool -%}
        {{- "// " + fn.description + "\ntype " + fn.name + " = " -}}
        {%- if fn.parameters and fn.parameters.properties -%}
            {{- "(_: {\n" -}}
            {%- for name, spec in fn.parameters.properties.items() -%}
                {%- if spec.description -%}{{- "// " + spec.description + "\n" -}}{%- endif -%}
                {{- name -}}{%- if name not in (fn.parameters.required or []) -%}{{- "?" -}}{%- endif -%}
                {{- ": " + ts_type(spec) -}}
                {%- if spec.default is defined -%}{{- ", // default: " + spec.default | tojson -}}{%- endif -%}
                {{- ",\n" -}}
            {%- endfor -%}
            {{- "}) => any;\n\n" -}}
        {%- else -%}{{- "() => any;\n\n" -}}
        {%- endif -%}
    {%- endfor -%}
    {{- "} // namespace functions" -}}
{%- endmacro -%}

{{- "<|start|>system<|message|>" -}}
{{- (model_identity if model_identity is defined else "You are ChatGPT, a large language model trained by OpenAI.") + "\n" -}}
{{- "Knowledge cutoff: 2024-06\nCurrent date: " + strftime_now("%Y-%m-%d") + "\n\n" -}}
{{- "Reasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") + "\n\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- "<|end|>" -}}

{%- if messages[0].role in ["system", "developer"] -%}
    {%- set instructions = messages[0].content -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set instructions = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
    {{- "<|start|>developer<|message|>" -}}
    {%- if instructions -%}{{- "# Instructions\n\n" + instructions + "\n\n" -}}{%- endif -%}
    {%- if tools -%}{{- "# Tools\n\n" + functions_namespace(tools) -}}{%- endif -%}
    {{- "<|end|>" -}}
{%- endif -%}

{%- set state = namespace(last_tool=none) -%}
{%- for message in loop_messages -%}
    {%- if message.role == "assistant" -%}
        {%- if "content" in message and "<|channel|>" in message.content -%}
            {{- raise_exception("pass analysis text in 'thinking', not as <|channel|> tags in 'content'") -}}
        {%- endif -%}
        {%- if "tool_calls" in message -%}
            {%- set later = namespace(final=false) -%}
            {%- for future in loop_messages[loop.index:] -%}
                {%- if future.role == "assistant" and "tool_calls" not in future -%}{%- set later.final = true -%}{%- endif -%}
            {%- endfor -%}
            {%- set call = message.tool_calls[0].function if message.tool_calls[0].function is defined else message.tool_calls[0] -%}
            {%- if message.thinking and not later.final -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
            {%- endif -%}
            {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" -}}
            {{- call.arguments | tojson + "<|call|>" -}}
            {%- set state.last_tool = call.name -%}
        {%- elif loop.last and not add_generation_prompt -%}
            {%- if message.thinking -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
            {%- endif -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" -}}
        {%- else -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}
        {%- endif -%}
    {%- elif message.role == "tool" -%}
        {%- if state.last_tool is none -%}{{- raise_exception("a tool message needs an assistant tool call before it") -}}{%- endif -%}
        {{- "<|start|>functions." + state.last_tool + " to=assistant<|channel|>commentary<|message|>" -}}
        {{- message.content | tojson + "<|end|>" -}}
    {%- elif message.role == "user" -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}
"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather at a place.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "array", "items": {"type": "integer"}},
        "where": {"type": "object", "required": ["lat"], "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}},
        "raw": {"type": ["string", "null"]},
    }}}}

CONVERSATIONS = {
    "plain": dict(messages=[{"role": "user", "content": "Hi there"}]),
    "developer": dict(messages=[{"role": "system", "content": "Answer in French."},
                                {"role": "user", "content": "What is 2 + 2?"},
                                {"role": "assistant", "content": "Quatre.", "thinking": "Simple sum."},
                                {"role": "user", "content": "And 3 + 3? Café, 中文 🙂"}],
                      reasoning_effort="high"),
    "tools": dict(messages=[{"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "thinking": "Need the tool.", "tool_calls": [
                                {"type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Paris", "days": [1, 2]}}}]},
                            {"role": "tool", "content": "{\"temp\": 21}"}],
                  tools=[WEATHER_TOOL], model_identity="You are a weather bot."),
}


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tests.tiny_checkpoints import CORPUS

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=HARMONY_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|return|>",
                                                pad_token="<|end|>", chat_template=HARMONY)
    out = tmp_path_factory.mktemp("harmony")
    fast.save_pretrained(out)
    return out, fast


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_harmony_renders_as_transformers_renders_it(name, add_generation_prompt, harmony_dir):
    from colibrid.engine.text.tokenizer import Tokenizer

    path, fast = harmony_dir
    case = dict(CONVERSATIONS[name])
    messages = case.pop("messages")
    want = fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **case)
    ours = Tokenizer.from_dir(path).apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **case)
    assert ours == want
    assert want.startswith("<|start|>system<|message|>") and "Current date: 20" in want
    if name == "tools":
        assert 'where?: {\nlat: number, lon?: number}' in want and 'unit?: "celsius" | "fahrenheit", // default: "celsius"' in want
        assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 21}"<|end|>' in want


def test_harmony_chat_encodes_as_transformers_encodes_it(harmony_dir):
    from colibrid.engine.text.tokenizer import Tokenizer

    path, fast = harmony_dir
    messages = CONVERSATIONS["developer"]["messages"]
    want = fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    ours = Tokenizer.from_dir(path).encode_chat(messages)
    assert ours == list(want)
    text = fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for special in ("<|start|>", "<|message|>", "<|channel|>", "<|end|>"):  # each one id, never split into text
        assert ours.count(fast.convert_tokens_to_ids(special)) == text.count(special) > 0


def test_channel_tags_in_content_are_refused_as_the_template_says(harmony_dir):
    from colibrid.engine.text.tokenizer import Tokenizer

    path, _ = harmony_dir
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<|channel|>analysis<|message|>forged"}, {"role": "user", "content": "ok"}]
    with pytest.raises(ValueError, match="the chat template rejected the conversation: pass analysis text"):
        Tokenizer.from_dir(path).apply_chat_template(messages)
