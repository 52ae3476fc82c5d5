"""Chat templates: the built-in DeepSeek-V3 template's rules, parity with transformers, the sandbox, errors."""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import datetime

import jinja2
import pytest

from deepinfer.errors import ConfigError, InvalidInputError
from deepinfer.text import DEEPSEEK_V3_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError, Tokenizer

# DeepSeek-V3-0324's published template, verbatim: real-world input for the transformers parity checks.
DEEPSEEK_V3_0324_TEMPLATE = r"""{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"""

# An HF-style template touching what Hub templates use: tools, tool_calls with mapping arguments, reasoning_content,
# tool results, raise_exception, namespace, loop controls, tojson with options, strftime_now, bos/eos tokens.
HF_STYLE_TEMPLATE = """{{- bos_token }}
{%- if tools %}
<tools>{{ tools | tojson(indent=2) }}</tools>
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'system' and not loop.first %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
<|{{ message.role }}|>
    {%- if message.reasoning_content is defined %}<r>{{ message.reasoning_content }}</r>{% endif %}
    {{- message.content if message.content is string else '' }}
    {%- for call in message.tool_calls | default([]) %}
<call name="{{ call.function.name }}">{{ call.function.arguments | tojson(sort_keys=true) }}</call>
    {%- endfor %}
    {%- if message.role == 'tool' %}[for {{ message.tool_call_id }}]{% endif %}
    {%- if message.role == 'assistant' %}{{ eos_token }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>{{ ns.turns }} {{ strftime_now('%Y') }}
{%- endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "sunny"}'},
    {"role": "assistant", "content": "It is sunny and 21 °C in Paris."},
    {"role": "user", "content": "And tomorrow?"},
]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_and_turns": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello. 你好"},
        {"role": "user", "content": "Tell me a joke <not a tag>"},
    ],
    "tool_round": TOOL_CONVERSATION,
    "ends_in_tool_result": TOOL_CONVERSATION[:4],
    "reasoning_in_history": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "3+3?"},
    ],
}


def test_builtin_template_renders_tool_conversation_exactly(tokenizer: Tokenizer):
    assert tokenizer.uses_builtin_chat_template
    text = tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    tool_schema = (
        '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
    )
    expected = (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.\n\n"
        "## Tools\n\nYou can call these functions, each given by its JSON schema:\n"
        + tool_schema
        + "\n\nTo call functions, write <｜tool▁calls▁begin｜>, then for each call "
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜> "
        "(one call per line), then <｜tool▁calls▁end｜>."
        "<｜User｜>What's the weather in Paris?"
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"temp_c": 21, "sky": "sunny"}<｜tool▁output▁end｜>'
        "<｜tool▁outputs▁end｜>It is sunny and 21 °C in Paris.<｜end▁of▁sentence｜>"
        "<｜User｜>And tomorrow?<｜Assistant｜>"
    )
    assert text == expected


def test_builtin_template_after_tool_results_the_model_continues_without_assistant_marker(tokenizer: Tokenizer):
    text = tokenizer.apply_chat_template(TOOL_CONVERSATION[:4], add_generation_prompt=True)
    assert text == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What's the weather in Paris?"
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"temp_c": 21, "sky": "sunny"}<｜tool▁output▁end｜>'
        "<｜tool▁outputs▁end｜>"
    )


def test_builtin_template_two_calls_two_results_two_rounds_and_reasoning_dropped(tokenizer: Tokenizer):
    messages = [
        {"role": "system", "content": "S1"},
        {"role": "system", "content": [{"type": "text", "text": "S2"}]},
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "must not appear",
            "tool_calls": [
                {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}},
                {"type": "function", "function": {"name": "b", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "A"},
        {"role": "tool", "content": "B"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "c", "arguments": "{}"}}]},
        {"role": "tool", "content": "C"},
        {"role": "assistant", "content": "<think>hidden</think>Done."},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    call = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
    assert text == (
        "<｜begin▁of▁sentence｜>S1\n\nS2<｜User｜>Q<｜Assistant｜>Checking.<｜tool▁calls▁begin｜>"
        + call.format("a", '{"x": 1}')
        + "\n"
        + call.format("b", "{}")
        + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜>"
        "<｜tool▁output▁begin｜>A<｜tool▁output▁end｜><｜tool▁output▁begin｜>B<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜><｜tool▁calls▁begin｜>"
        + call.format("c", "{}")
        + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>C<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>Done.<｜end▁of▁sentence｜>"
    )


def test_builtin_template_rejects_unknown_role_with_typed_error(tokenizer: Tokenizer):
    with pytest.raises(ChatTemplateError, match="unsupported message role: robot") as info:
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert isinstance(info.value, InvalidInputError)
    with pytest.raises(ChatTemplateError, match="no function name"):
        tokenizer.apply_chat_template([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}])


@pytest.mark.parametrize("template_name", ["builtin_v3", "deepseek_v3_0324", "hf_style"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_matches_transformers_apply_chat_template(
    make_tokenizer_folder, hf_tokenizer_for, template_name, conversation, add_generation_prompt
):
    folder = _template_folder(make_tokenizer_folder, template_name)
    ours, theirs = Tokenizer.from_folder(folder), hf_tokenizer_for(folder)
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if conversation == "tool_round" else None
    if template_name == "hf_style":  # mapping arguments, as transformers' docs write them
        messages = json.loads(json.dumps(messages).replace('"{\\"city\\": \\"Paris\\"}"', '{"city": "Paris"}'))
    options = {"tools": tools, "add_generation_prompt": add_generation_prompt}
    try:
        expected = theirs.apply_chat_template(messages, tokenize=False, **options)
    except jinja2.TemplateError as e:  # e.g. DeepSeek's own template on `content: null`: both must refuse
        with pytest.raises(ChatTemplateError, match=re.escape(str(e))):
            ours.apply_chat_template(messages, **options)
        return
    assert ours.apply_chat_template(messages, **options) == expected
    expected_ids = theirs.apply_chat_template(messages, tokenize=True, **options)
    if hasattr(expected_ids, "keys"):
        expected_ids = expected_ids["input_ids"]
    assert ours.apply_chat_template(messages, tokenize=True, **options) == list(expected_ids)


_TEMPLATE_FOLDERS: dict[str, object] = {}


def _template_folder(make_tokenizer_folder, name: str):
    if name not in _TEMPLATE_FOLDERS:
        source = {
            "builtin_v3": DEEPSEEK_V3_CHAT_TEMPLATE,
            "deepseek_v3_0324": DEEPSEEK_V3_0324_TEMPLATE,
            "hf_style": HF_STYLE_TEMPLATE,
        }[name]
        _TEMPLATE_FOLDERS[name] = make_tokenizer_folder(config={"chat_template": source})
    return _TEMPLATE_FOLDERS[name]


def test_hf_style_template_sees_globals(make_tokenizer_folder):
    tok = Tokenizer.from_folder(_template_folder(make_tokenizer_folder, "hf_style"))
    text = tok.apply_chat_template(CONVERSATIONS["reasoning_in_history"], tools=TOOLS, add_generation_prompt=True)
    assert text.startswith('<｜begin▁of▁sentence｜><tools>[\n  {\n    "type": "function",')
    assert "<r>Add them.</r>4<｜end▁of▁sentence｜>" in text
    assert text.endswith(f"<|assistant|>3 {datetime.now():%Y}")


def test_continue_final_message_matches_transformers(make_tokenizer_folder, hf_tokenizer_for):
    folder = _template_folder(make_tokenizer_folder, "builtin_v3")
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}]
    expected = hf_tokenizer_for(folder).apply_chat_template(messages, continue_final_message=True, tokenize=False)
    got = Tokenizer.from_folder(folder).apply_chat_template(messages, continue_final_message=True)
    assert got == expected == "<｜begin▁of▁sentence｜><｜User｜>Count<｜Assistant｜>1, 2, "


def test_raise_exception_message_reaches_the_caller(tokenizer: Tokenizer):
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}"
        "{% endif %}ok"
    )
    with pytest.raises(ChatTemplateError) as info:
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}], chat_template=template)
    assert str(info.value) == "Conversations must start with a user turn"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template) == "ok"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['__builtins__'] }}",
        "{% set x = messages.append(1) %}{{ x }}",
        "{% set x = messages[0].update({'role': 'x'}) %}",
        "{% set ns = namespace(__class__=1) %}",
        "{% set ns = namespace() %}{% set ns._private = 1 %}",
        "{{ dict.__call__.__globals__ }}",
        "{{ strftime_now.__globals__['datetime'] }}",
    ],
)
def test_templates_cannot_reach_python_internals(tokenizer: Tokenizer, template: str):
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for %}", "syntax error on line 1"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
        ("{{ messages[5].content.upper() }}", "no element 5"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ],
)
def test_template_failures_become_chat_template_errors(tokenizer: Tokenizer, template: str, message: str):
    with pytest.raises(ChatTemplateError, match=message):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)


@pytest.mark.parametrize(
    "messages", [[], "hello", [{"role": "user", "content": "x"}, "oops"], {"role": "user"}]
)
def test_malformed_messages_are_input_errors(tokenizer: Tokenizer, messages):
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template(messages)


def test_objects_reach_templates_as_plain_data(tokenizer: Tokenizer):
    @dataclasses.dataclass
    class Message:
        role: str
        content: object

    template = "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"
    got = tokenizer.apply_chat_template([Message("user", "hi"), Message("user", object())], chat_template=template)
    assert got == "user=hi;user=<object>;"


def test_named_templates_and_template_files(make_tokenizer_folder):
    folder = make_tokenizer_folder(
        config={"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}
    )
    tok = Tokenizer.from_folder(folder)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "D"
    assert tok.apply_chat_template(messages, tools=TOOLS) == "T"
    assert tok.apply_chat_template(messages, chat_template="tool_use") == "T"
    (folder / "chat_template.jinja").write_text("J{{ messages | length }}", encoding="utf-8")
    assert Tokenizer.from_folder(folder).apply_chat_template(messages) == "J1"


def test_broken_checkpoint_template_fails_at_load(make_tokenizer_folder):
    folder = make_tokenizer_folder(config={"chat_template": "{% if %}"})
    with pytest.raises(ConfigError, match="syntax error"):
        Tokenizer.from_folder(folder)


def test_chat_template_class_directly():
    template = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ enable_thinking }}")
    special_tokens = {"bos_token": "<s>", "eos_token": None}
    text = template.render([{"role": "user", "content": "hi"}], special_tokens=special_tokens, enable_thinking=True)
    assert text == "<s>hiTrue"
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="tools must be"):
        template.render([{"role": "user", "content": "hi"}], tools=["get_weather"])
