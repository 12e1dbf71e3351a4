"""`post` with a BERT config and BERT's weights (copied here by hand, not by the converter) is BertModel."""

import pytest
import torch
from conftest import BACKENDS, batch, real
from transformers import BertConfig, BertModel

from encoderstack import EncoderStackConfig, EncoderStackModel

BERT = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 37,
    "max_position_embeddings": 64,
    "hidden_act": "gelu",
}


def copy_bert_into_encoderstack(bert: BertModel, ours: EncoderStackModel) -> None:
    source = bert.state_dict()
    names = {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight": "embeddings.norm.weight",
        "embeddings.LayerNorm.bias": "embeddings.norm.bias",
        "pooler.dense.weight": "pooler.dense.weight",
        "pooler.dense.bias": "pooler.dense.bias",
    }
    for i in range(bert.config.num_hidden_layers):
        b, o = f"encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            names |= {
                f"{b}attention.self.query.{kind}": f"{o}attention.query.{kind}",
                f"{b}attention.self.key.{kind}": f"{o}attention.key.{kind}",
                f"{b}attention.self.value.{kind}": f"{o}attention.value.{kind}",
                f"{b}attention.output.dense.{kind}": f"{o}attention.output.{kind}",
                f"{b}attention.output.LayerNorm.{kind}": f"{o}attention_residual.norm_out.{kind}",
                f"{b}intermediate.dense.{kind}": f"{o}mlp.up.{kind}",
                f"{b}output.dense.{kind}": f"{o}mlp.down.{kind}",
                f"{b}output.LayerNorm.{kind}": f"{o}mlp_residual.norm_out.{kind}",
            }
    ours.load_state_dict({names[key]: value for key, value in source.items()}, strict=True)


@pytest.fixture(scope="module")
def bert_pair():
    torch.manual_seed(0)
    bert = BertModel(BertConfig(**BERT)).eval()
    with torch.no_grad():
        for param in bert.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    ours = EncoderStackModel(EncoderStackConfig(**BERT)).eval()
    copy_bert_into_encoderstack(bert, ours)
    return bert, ours


@pytest.mark.parametrize("backend", BACKENDS)
def test_post_ln_reproduces_bert_model_on_every_output(bert_pair, backend):
    bert, ours = bert_pair
    inputs = batch()
    mask = inputs["attention_mask"]
    for model in bert_pair:
        model.set_attn_implementation(backend)
    with torch.no_grad():
        expected = bert(**inputs, output_hidden_states=True, output_attentions=backend == "eager")
        actual = ours(**inputs, output_hidden_states=True, output_attentions=backend == "eager")
    torch.testing.assert_close(
        real(actual.last_hidden_state, mask), real(expected.last_hidden_state, mask), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, atol=1e-5, rtol=0)
    assert len(actual.hidden_states) == len(expected.hidden_states) == 3
    for a, e in zip(actual.hidden_states, expected.hidden_states):
        torch.testing.assert_close(real(a, mask), real(e, mask), atol=1e-5, rtol=0)
    if backend == "eager":
        assert len(actual.attentions) == 2
        for a, e in zip(actual.attentions, expected.attentions):
            # queries of real tokens over every key: padded keys carry zero weight in both
            torch.testing.assert_close(
                a.transpose(1, 2)[mask.bool()], e.transpose(1, 2)[mask.bool()], atol=1e-5, rtol=0
            )


def test_post_ln_gradients_match_bert_after_one_backward_pass(bert_pair):
    bert, ours = bert_pair
    inputs = batch()
    mask = inputs["attention_mask"].bool()
    for model in bert_pair:
        model.zero_grad()
        out = model(**inputs)
        (real(out.last_hidden_state, mask).pow(2).sum() + out.pooler_output.sum()).backward()
    # to 1e-5 of each gradient's largest entry: a gradient's scale is the loss's, not O(1) like the outputs
    for mine, theirs in (
        (ours.layers[0].attention.query, bert.encoder.layer[0].attention.self.query),
        (ours.embeddings.word_embeddings, bert.embeddings.word_embeddings),
        (ours.layers[1].mlp_residual.norm_out, bert.encoder.layer[1].output.LayerNorm),
    ):
        scale = theirs.weight.grad.abs().max()
        torch.testing.assert_close(mine.weight.grad / scale, theirs.weight.grad / scale, atol=1e-5, rtol=0)
