"""Chat templates (`disagg.server.chat_template`) and where the loaders find them.

Fast tests use small hand-written templates and the tiny byte-level vocabulary from conftest.
Slow tests load SmolLM2 and compare our text and token ids with transformers'
`apply_chat_template` on the same GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from disagg.errors import ModelLoadError
from disagg.model.loading.hf import read_hf_chat_template
from disagg.model.loading.registry import LoadedModel, load_model
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server.chat_template import ChatTemplate, require_chat_template
from disagg.server.errors import ChatTemplateError

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
USER = [{"role": "user", "content": "hi"}]


def _write_tokenizer_config(directory: Path, **fields: Any) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "tokenizer_config.json").write_text(json.dumps(fields))
    return directory


def test_hf_template_string_from_tokenizer_config(tmp_path: Path) -> None:
    directory = _write_tokenizer_config(tmp_path / "m", chat_template="{{ messages[0].content }}")
    assert read_hf_chat_template(directory) == "{{ messages[0].content }}"


def test_hf_template_list_uses_default_entry(tmp_path: Path) -> None:
    directory = _write_tokenizer_config(tmp_path / "m", chat_template=[
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}])
    assert read_hf_chat_template(directory) == "plain"


def test_hf_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    directory = _write_tokenizer_config(tmp_path / "m", chat_template="from config")
    (directory / "chat_template.jinja").write_text("from file")
    assert read_hf_chat_template(directory) == "from file"


def test_hf_malformed_template_field_is_a_load_error(tmp_path: Path) -> None:
    directory = _write_tokenizer_config(tmp_path / "m", chat_template={"default": "x"})
    with pytest.raises(ModelLoadError, match="tokenizer_config.json: chat_template"):
        read_hf_chat_template(directory)


def test_load_model_carries_hf_checkpoint_template(make_hf_llama_checkpoint) -> None:  # noqa: ANN001
    directory = _write_tokenizer_config(make_hf_llama_checkpoint(), chat_template=CHATML)
    assert load_model(str(directory)).chat_template == CHATML


def test_preset_has_no_chat_template() -> None:
    assert load_model("tiny").chat_template is None


def test_model_without_template_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="model 'tiny' has no chat template"):
        require_chat_template("tiny", None)


def test_render_passes_special_tokens_and_generation_prompt() -> None:
    template = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
                            "{% if add_generation_prompt %}GO{% endif %}", "<s>", "</s>")
    assert template.render(USER) == "<s>hi</s>GO"
    assert template.render(USER, add_generation_prompt=False) == "<s>hi</s>"


def test_trim_and_lstrip_blocks_apply() -> None:
    template = ChatTemplate("  {% for m in messages %}\n[{{ m.content }}]\n  {% endfor %}\n",
                            None, None)
    assert template.render(USER) == "[hi]\n"


def test_extra_variables_reach_the_template() -> None:
    template = ChatTemplate("{{ tools | length }} {{ messages[0].role }}", None, None)
    assert template.render(USER, tools=[{"name": "a"}, {"name": "b"}]) == "2 user"


def test_raise_exception_becomes_chat_template_error() -> None:
    template = ChatTemplate("{% if messages[0].role != 'system' %}"
                            "{{ raise_exception('first message must be system') }}{% endif %}",
                            None, None)
    with pytest.raises(ChatTemplateError, match="first message must be system") as caught:
        template.render(USER)
    assert caught.value.param == "messages"


def test_template_failing_on_a_message_becomes_chat_template_error() -> None:
    """SmolLM2's template adds strings; an assistant turn without content breaks it."""
    template = ChatTemplate("{% for m in messages %}{{ 'x' + m['content'] }}{% endfor %}",
                            None, None)
    with pytest.raises(ChatTemplateError, match="cannot render"):
        template.render([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])


def test_tojson_keeps_non_ascii_and_takes_indent() -> None:
    template = ChatTemplate("{{ messages[0] | tojson }}|{{ {'a': 1} | tojson(indent=2) }}",
                            None, None)
    text = template.render([{"role": "user", "content": "é <b>"}])
    assert text == '{"role": "user", "content": "é <b>"}|{\n  "a": 1\n}'


def test_strftime_now_is_available() -> None:
    assert len(ChatTemplate("{{ strftime_now('%Y') }}", None, None).render(USER)) == 4


def test_generation_tag_renders_its_body() -> None:
    template = ChatTemplate("{% generation %}{{ messages[0].content }}{% endgeneration %}!",
                            None, None)
    assert template.render(USER) == "hi!"


def test_syntax_error_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", None, None)


def test_text_parts_are_joined_and_none_fields_dropped() -> None:
    template = ChatTemplate("{{ messages[0].content }}|{{ messages[0].name is defined }}",
                            None, None)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert template.render([{"role": "user", "content": parts, "name": None}]) == "a\nb|False"


@pytest.mark.parametrize(("messages", "field"), [
    ("hello", "messages"),
    ([], "messages"),
    (["hello"], "messages[0]"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
    ([*USER, *USER, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[2].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
])
def test_bad_message_shape_names_the_field(messages: Any, field: str) -> None:
    with pytest.raises(ChatTemplateError) as caught:
        ChatTemplate(CHATML, None, None).render(messages)
    assert caught.value.param == field
    assert caught.value.message.startswith(f"{field} ")


def test_special_markers_encode_as_single_ids(tiny_tokenizer: Tokenizer) -> None:
    template = ChatTemplate.for_tokenizer(CHATML, tiny_tokenizer)
    ids = template.encode(template.render(USER), tiny_tokenizer)
    im_start, im_end = tiny_tokenizer.token_to_id("<|im_start|>"), tiny_tokenizer.token_to_id(
        "<|im_end|>")
    assert ids.count(im_start) == 2
    assert ids.count(im_end) == 1
    assert tiny_tokenizer.decode(ids) == template.render(USER)


def test_bos_is_not_added_twice(tiny_gguf_vocab: dict[str, Any]) -> None:
    """A tokenizer that prepends BOS itself: the template's own BOS is the only one."""
    tokenizer = Tokenizer.from_gguf_vocab(**tiny_gguf_vocab, pre="smollm", bos_token_id=0,
                                          eos_token_ids=[2], add_bos_token=True)
    template = ChatTemplate.for_tokenizer("{{ bos_token }}{{ messages[0].content }}", tokenizer)
    text = template.render(USER)
    assert tokenizer.encode(text)[:2] == [0, 0]  # what plain encoding would send
    ids = template.encode(text, tokenizer)
    assert ids[0] == 0
    assert ids.count(0) == 1


# SmolLM2 against transformers on the same GGUF.

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 12 + 30?"}],
    "system+user": [{"role": "system", "content": "You answer in French."},
                    {"role": "user", "content": "Héllo 🤗, how are you?"}],
    "multi-turn": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Name a colour."},
                   {"role": "assistant", "content": "Blue."},
                   {"role": "user", "content": "Another one,\n please."}],
}


@pytest.fixture(scope="module")
def smollm2_template(smollm2_model: LoadedModel) -> ChatTemplate:
    assert smollm2_model.chat_template is not None
    assert smollm2_model.tokenizer is not None
    return ChatTemplate.for_tokenizer(smollm2_model.chat_template, smollm2_model.tokenizer)


@pytest.mark.slow
def test_smollm2_template_comes_from_the_gguf(smollm2_model: LoadedModel,
                                              hf_smollm2_tokenizer: Any) -> None:
    assert smollm2_model.chat_template == hf_smollm2_tokenizer.chat_template


@pytest.mark.slow
def test_smollm2_special_token_spellings_match_transformers(smollm2_template: ChatTemplate,
                                                            hf_smollm2_tokenizer: Any) -> None:
    assert smollm2_template.bos_token == hf_smollm2_tokenizer.bos_token
    assert smollm2_template.eos_token == hf_smollm2_tokenizer.eos_token


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_text_matches_transformers(smollm2_template: ChatTemplate,
                                           hf_smollm2_tokenizer: Any, name: str,
                                           add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smollm2_template.render(messages, add_generation_prompt) == expected


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_ids_match_transformers(smollm2_template: ChatTemplate,
                                        smollm2_model: LoadedModel, hf_smollm2_tokenizer: Any,
                                        name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt)
    assert smollm2_model.tokenizer is not None
    ours = smollm2_template.render_ids(messages, smollm2_model.tokenizer, add_generation_prompt)
    assert ours == list(expected)


@pytest.mark.slow
def test_smollm2_markers_are_single_ids(smollm2_template: ChatTemplate,
                                        smollm2_model: LoadedModel) -> None:
    assert smollm2_model.tokenizer is not None
    ids = smollm2_template.render_ids(CONVERSATIONS["user"], smollm2_model.tokenizer)
    im_start = smollm2_model.tokenizer.token_to_id("<|im_start|>")
    assert ids[0] == im_start
    assert ids.count(im_start) == 3  # system, user and the assistant header
