"""Chat templates found and rendered as `transformers` finds and renders them.

The goldens below are literal strings. They were produced by, and are checked
again here against, an independent renderer written in this file: a jinja2
sandboxed environment configured as transformers documents its chat-template
environment (`trim_blocks=True`, `lstrip_blocks=True`, the `loopcontrols`
extension, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII),
rendered with `messages`, `tools`, `documents`, `add_generation_prompt` and the
special tokens. transformers itself is not installed where these tests were
written (it needs torch); `test_transformers_renders_the_same` compares with its
`apply_chat_template` on the same tokenizer files wherever it is installed.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import shutil

import pytest

jinja2 = pytest.importorskip("jinja2", reason="chat templates need jinja2 (the serve extra)")
pytest.importorskip("tokenizers", reason="the tokenizer needs the tokenizers package")

from jinja2 import ext, sandbox  # noqa: E402

from jaxkv.tokenizer import Tokenizer  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
SPECIAL = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")

# A default system prompt, a role check with raise_exception, trim and whitespace control.
SYSTEM = """{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system = 'You are helpful.' %}
    {%- set rest = messages %}
{%- endif %}
{{ bos_token }}[SYS]{{ system }}[/SYS]
{% for m in rest %}
    {% if m['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + m['role']) }}
    {% endif %}
<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>
{% endfor %}
{% if add_generation_prompt %}
<assistant>
{% endif %}
"""
# Loop controls (continue, break) and the eos token without a generation prompt.
LOOPS = """{% for m in messages %}
  {% if m.role == 'tool' %}{% continue %}{% endif %}
  {% if loop.index > 3 %}{% break %}{% endif %}
{{ loop.index }}:{{ m.role }}={{ m.content }}
{% endfor %}
{{- eos_token if not add_generation_prompt else '>>' }}"""
# Tools, tojson of non-ASCII text, strftime_now.
TOOLS = """{% if tools %}
Tools: {{ tools | tojson }}
{% endif %}
Date: {{ strftime_now('%Y-%m-%d') }}
{% for m in messages %}
{{ m.role | upper }}: {{ m.content | tojson }}
{% endfor %}"""
# transformers' {% generation %} block (it marks the assistant's tokens; the text is the body).
GENERATION = """{% for m in messages %}
{% if m.role == 'assistant' %}
{% generation %}A: {{ m.content }}{{ eos_token }}{% endgeneration %}

{% else %}
U: {{ m.content }}
{% endif %}
{% endfor %}"""

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Héllo 你好  "},
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}]
LOOP_CHAT = [{"role": "user", "content": "a"}, {"role": "tool", "content": "t"},
             {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
             {"role": "user", "content": "d"}]
TOOL_LIST = [{"type": "function", "function": {"name": "météo"}}]
TODAY = "{today}"   # replaced by the date at test time (strftime_now)

# (template, messages, keyword arguments, golden)
CASES = {
    "system": (SYSTEM, CHAT, dict(add_generation_prompt=True),
               "<s>[SYS]Be brief.[/SYS]\n<user>Héllo 你好</user>\n<assistant>Hi.</assistant>\n"
               "<user>Bye</user>\n<assistant>\n"),
    "default_system": (SYSTEM, CHAT[1:3], dict(add_generation_prompt=False),
                       "<s>[SYS]You are helpful.[/SYS]\n<user>Héllo 你好</user>\n"
                       "<assistant>Hi.</assistant>\n"),
    "loops": (LOOPS, LOOP_CHAT, dict(add_generation_prompt=False),
              "1:user=a\n3:assistant=b\n</s>"),
    "tools": (TOOLS, CHAT[1:3], dict(add_generation_prompt=True, tools=TOOL_LIST),
              'Tools: [{"type": "function", "function": {"name": "météo"}}]\nDate: {today}\n'
              'USER: "  Héllo 你好  "\nASSISTANT: "Hi."\n'),
}


def _independent(template: str, messages, add_generation_prompt: bool, tools=None) -> str:
  """The reference renderer (module docstring): jinja2 set up as transformers documents it."""
  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env.filters["tojson"] = lambda x, **kw: json.dumps(x, **{"ensure_ascii": False, **kw})
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template).render(messages=messages, tools=tools, documents=None,
                                          add_generation_prompt=add_generation_prompt, **SPECIAL)


def _golden(text: str) -> str:
  return text.replace(TODAY, datetime.date.today().isoformat())


def _checkpoint(path, *, config_template=None, file_template=None, additional=None) -> str:
  """The Llama fixture's tokenizer files with the given chat templates."""
  os.makedirs(path)
  shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), path / "tokenizer.json")
  with open(os.path.join(FIXTURE, "tokenizer_config.json"), encoding="utf-8") as f:
    config = json.load(f)
  config.pop("chat_template")
  if config_template is not None:
    config["chat_template"] = config_template
  (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
  if file_template is not None:
    (path / "chat_template.jinja").write_text(file_template, encoding="utf-8")
  for name, template in (additional or {}).items():
    os.makedirs(path / "additional_chat_templates", exist_ok=True)
    (path / "additional_chat_templates" / f"{name}.jinja").write_text(template, encoding="utf-8")
  return str(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_goldens_match_the_independent_renderer_and_jaxkv(tmp_path, case):
  template, messages, kwargs, golden = CASES[case]
  tok = Tokenizer.from_checkpoint(_checkpoint(tmp_path / case, config_template=template))
  assert _independent(template, messages, **kwargs) == _golden(golden)
  assert tok.render_chat(messages, **kwargs) == _golden(golden)


def test_raise_exception_refuses_by_the_templates_message(tmp_path):
  tok = Tokenizer.from_checkpoint(_checkpoint(tmp_path / "c", config_template=SYSTEM))
  with pytest.raises(ValueError, match="the chat template refused the messages: unknown role: "
                                       "tool"):
    tok.render_chat([{"role": "tool", "content": "x"}])


def test_the_jinja_file_overrides_the_config_key(tmp_path):
  tok = Tokenizer.from_checkpoint(_checkpoint(tmp_path / "c", config_template="WRONG",
                                              file_template=SYSTEM))
  assert tok.render_chat(CHAT) == CASES["system"][3]


def test_named_templates_in_the_config(tmp_path):
  named = [{"name": "default", "template": LOOPS}, {"name": "tool_use", "template": TOOLS}]
  tok = Tokenizer.from_checkpoint(_checkpoint(tmp_path / "c", config_template=named))
  assert tok.render_chat(LOOP_CHAT, add_generation_prompt=False) == CASES["loops"][3]
  # With tools the "tool_use" template; by name also without.
  want = _golden(CASES["tools"][3])
  assert tok.render_chat(CHAT[1:3], tools=TOOL_LIST) == want
  assert tok.render_chat(CHAT[1:3], chat_template="tool_use") == want.split("\n", 1)[1]


def test_additional_template_files(tmp_path):
  tok = Tokenizer.from_checkpoint(_checkpoint(
      tmp_path / "c", config_template="WRONG", file_template=SYSTEM,
      additional={"tool_use": TOOLS, "gen": GENERATION}))
  assert tok.render_chat(CHAT) == CASES["system"][3]
  assert tok.render_chat(CHAT[1:3], tools=TOOL_LIST) == _golden(CASES["tools"][3])
  messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
  assert tok.render_chat(messages, chat_template="gen") == "U: Hi\nA: Yo</s>\n"
  # Files without chat_template.jinja replace the config key too: no default then.
  tok = Tokenizer.from_checkpoint(_checkpoint(tmp_path / "d", config_template=SYSTEM,
                                              additional={"gen": GENERATION}))
  with pytest.raises(ValueError, match="none is named 'default'"):
    tok.render_chat(messages)
  assert tok.render_chat(messages, chat_template="gen") == "U: Hi\nA: Yo</s>\n"


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="the cross-check needs transformers (the GPU check's host has it)")
def test_transformers_renders_the_same(tmp_path):
  import transformers   # pylint: disable=g-import-not-at-top
  ckpt = _checkpoint(tmp_path / "t", config_template="WRONG", file_template=SYSTEM,
                     additional={"tool_use": TOOLS, "loops": LOOPS, "gen": GENERATION})
  ours, theirs = Tokenizer.from_checkpoint(ckpt), transformers.AutoTokenizer.from_pretrained(ckpt)
  calls = [(CHAT, dict(add_generation_prompt=True)),
           (CHAT[1:3], dict(add_generation_prompt=False)),
           (CHAT[1:3], dict(add_generation_prompt=True, tools=TOOL_LIST)),
           (LOOP_CHAT, dict(add_generation_prompt=False, chat_template="loops")),
           (CHAT[2:4], dict(add_generation_prompt=False, chat_template="gen"))]
  for messages, kwargs in calls:
    assert ours.render_chat(messages, **kwargs) == theirs.apply_chat_template(
        messages, tokenize=False, **kwargs), kwargs
