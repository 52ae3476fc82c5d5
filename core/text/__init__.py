"""Text: tokenizer, chat templates, incremental detokenizer and stream parsers.

How a chat request uses them:

    tok = Tokenizer.from_folder(checkpoint_dir)
    prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)  # the template wrote bos already
    detok = IncrementalDetokenizer(tok, keep_special_tokens=STREAM_MARKERS)  # markers must reach the parser
    parser = ChatStreamParser(reasoning=True, starts_in_reasoning=prompt_opens_reasoning(prompt), tools=bool(tools))
    for new_ids in engine_steps:  # stop tokens (eos) not included
        delta = parser.feed(detok.add(new_ids))  # delta.to_openai() is the chunk's `delta`
    last = parser.feed(detok.finish()); tail = parser.finish()
    finish_reason = parser.finish_reason("stop")  # "tool_calls" when the model called tools
"""

from deepinfer.text.chat_template import ChatTemplate, ChatTemplateError, choose_chat_template, load_chat_templates
from deepinfer.text.deepseek_v3_template import DEEPSEEK_V3_CHAT_TEMPLATE
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.markers import DEEPSEEK_V3_SPECIAL_TOKENS, STREAM_MARKERS
from deepinfer.text.reasoning_parser import ReasoningParser, prompt_opens_reasoning
from deepinfer.text.stream_parser import ChatDelta, ChatStreamParser, ParsedChatOutput, parse_chat_output
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.text.tool_parser import ToolCall, ToolCallDelta, ToolCallParser

__all__ = [
    "DEEPSEEK_V3_CHAT_TEMPLATE",
    "DEEPSEEK_V3_SPECIAL_TOKENS",
    "STREAM_MARKERS",
    "ChatDelta",
    "ChatStreamParser",
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "ParsedChatOutput",
    "ReasoningParser",
    "Tokenizer",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "choose_chat_template",
    "load_chat_templates",
    "parse_chat_output",
    "prompt_opens_reasoning",
]
