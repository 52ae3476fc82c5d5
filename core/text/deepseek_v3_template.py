"""The built-in DeepSeek-V3 chat template, used when a checkpoint folder ships none.

It follows the format of DeepSeek-V3's own template (V3-0324 revision) and fixes what that one gets wrong in
multi-round tool use. Its rules, which the tests pin with strings written out in full:

- `bos_token`, then the system messages' texts joined by a blank line.
- With `tools`: a "## Tools" section (after a blank line when there is a system prompt) listing each tool's
  JSON schema on its own line and explaining the tool-call format.
- user: `<｜User｜>` + text.
- assistant: `<｜Assistant｜>` + text, where text is cut after its last `</think>` (reasoning is never fed
  back; `reasoning_content` is ignored). Tool calls follow as `<｜tool▁calls▁begin｜>` + calls joined by a
  newline + `<｜tool▁calls▁end｜>`; one call is `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` newline
  "```json" newline ARGUMENTS newline "```" `<｜tool▁call▁end｜>`, ARGUMENTS being the OpenAI JSON string
  as given (a mapping is written as JSON). The turn ends with `<｜end▁of▁sentence｜>`.
- tool: results of one round share one `<｜tool▁outputs▁begin｜>` ... `<｜tool▁outputs▁end｜>` block, each
  as `<｜tool▁output▁begin｜>` + text + `<｜tool▁output▁end｜>`. The assistant turn answering them continues
  right after `<｜tool▁outputs▁end｜>`, without a new `<｜Assistant｜>`.
- `add_generation_prompt` appends `<｜Assistant｜>`, except after tool results (the model continues there).
- Content given as a list of parts keeps its text parts. Any other role raises, giving a ChatTemplateError.
"""

from __future__ import annotations

DEEPSEEK_V3_CHAT_TEMPLATE = r"""
{%- macro text_of(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part is mapping and part.get('type') == 'text' -%}{{- part.get('text', '') -}}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}

{%- macro tool_call(call) -%}
  {%- set fn = call.get('function', call) -%}
  {%- if fn.get('name') is not string -%}
    {{- raise_exception('an assistant tool call has no function name') -}}
  {%- endif -%}
  {%- set args = fn.get('arguments', '{}') -%}
  {{- '<｜tool▁call▁begin｜>' ~ call.get('type', 'function') ~ '<｜tool▁sep｜>' ~ fn['name'] -}}
  {{- '\n```json\n' ~ (args if args is string else args | tojson) ~ '\n```<｜tool▁call▁end｜>' -}}
{%- endmacro -%}

{%- set ns = namespace(system='', in_outputs=false) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- set ns.system = (ns.system ~ '\n\n' if ns.system else '') ~ text_of(message.get('content')) -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {%- set ns.system = (ns.system ~ '\n\n' if ns.system else '')
        ~ '## Tools\n\nYou can call these functions, each given by its JSON schema:' -%}
  {%- for tool in tools -%}
    {%- set ns.system = ns.system ~ '\n' ~ (tool | tojson) -%}
  {%- endfor -%}
  {%- set ns.system = ns.system
        ~ '\n\nTo call functions, write <｜tool▁calls▁begin｜>, then for each call '
        ~ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜> '
        ~ '(one call per line), then <｜tool▁calls▁end｜>.' -%}
{%- endif -%}
{{- bos_token ~ ns.system -}}

{%- for message in messages -%}
  {%- set role = message['role'] -%}
  {%- if role == 'user' -%}
    {%- if ns.in_outputs -%}
      {{- '<｜tool▁outputs▁end｜>' -}}
      {%- set ns.in_outputs = false -%}
    {%- endif -%}
    {{- '<｜User｜>' ~ text_of(message.get('content')) -}}
  {%- elif role == 'assistant' -%}
    {%- set content = text_of(message.get('content')) -%}
    {%- if '</think>' in content -%}
      {%- set content = content.split('</think>')[-1] -%}
    {%- endif -%}
    {%- if ns.in_outputs -%}
      {{- '<｜tool▁outputs▁end｜>' -}}
      {%- set ns.in_outputs = false -%}
    {%- else -%}
      {{- '<｜Assistant｜>' -}}
    {%- endif -%}
    {{- content -}}
    {%- if message.get('tool_calls') -%}
      {{- '<｜tool▁calls▁begin｜>' -}}
      {%- for call in message['tool_calls'] -%}
        {%- if not loop.first -%}{{- '\n' -}}{%- endif -%}
        {{- tool_call(call) -}}
      {%- endfor -%}
      {{- '<｜tool▁calls▁end｜>' -}}
    {%- endif -%}
    {{- '<｜end▁of▁sentence｜>' -}}
  {%- elif role == 'tool' -%}
    {%- if not ns.in_outputs -%}
      {{- '<｜tool▁outputs▁begin｜>' -}}
      {%- set ns.in_outputs = true -%}
    {%- endif -%}
    {{- '<｜tool▁output▁begin｜>' ~ text_of(message.get('content')) ~ '<｜tool▁output▁end｜>' -}}
  {%- elif role != 'system' -%}
    {{- raise_exception('unsupported message role: ' ~ role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if ns.in_outputs -%}
  {{- '<｜tool▁outputs▁end｜>' -}}
{%- elif add_generation_prompt -%}
  {{- '<｜Assistant｜>' -}}
{%- endif -%}
"""
