"""The config fields that let one model express the BERT family: a position offset that counts real tokens only, no
token types, an embedding projection, and the head layouts. Parity with each family's own class is in
test_convert_family.py; here, the mechanisms themselves, on every execution path."""

from unittest import mock

import pytest
import torch
from conftest import HEADS, batch, build, head_inputs
from test_left_padding import left_padded

import encoderstack

ROBERTA = {"position_offset": 2, "pad_token_id": 1, "type_vocab_size": 1, "head_layout": "roberta"}


def right_and_left(inputs):
    left = left_padded(inputs)
    del left["position_ids"]  # the model counts positions itself
    return inputs, left


def per_token(model, inputs, **kwargs):
    out = model(**inputs, output_hidden_states=False, **kwargs)
    return out.last_hidden_state[inputs["attention_mask"].bool()]


@pytest.mark.parametrize("padding_free", [True, False])
def test_with_a_position_offset_left_padding_gives_the_right_padded_outputs(padding_free):
    model = build(encoderstack.EncoderStackModel, **ROBERTA)
    inputs = {key: value for key, value in batch().items() if key != "token_type_ids"}
    right, left = right_and_left(inputs)
    torch.testing.assert_close(
        per_token(model, left, padding_free=padding_free), per_token(model, right), atol=1e-5, rtol=0
    )
    pooled = [model(**x, padding_free=padding_free).pooler_output for x in (left, right)]
    torch.testing.assert_close(*pooled, atol=1e-5, rtol=0)


def test_without_an_offset_positions_count_along_the_row_as_bert():
    model = build(encoderstack.EncoderStackModel)
    inputs = batch()
    right, left = right_and_left(inputs)
    assert not torch.allclose(per_token(model, left, padding_free=False), per_token(model, right), atol=1e-3)


def test_a_position_offset_counts_from_the_offset_in_each_sequence_alone_and_in_flattened_rows():
    model = build(encoderstack.EncoderStackModel, **ROBERTA)
    ids = torch.randint(2, 99, (1, 9), generator=torch.Generator().manual_seed(3))
    alone = [model(input_ids=ids[:, a:b]).last_hidden_state[0] for a, b in ((0, 4), (4, 9))]
    flattened = model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 4, 9]), max_length_q=5).last_hidden_state[0]
    torch.testing.assert_close(flattened, torch.cat(alone), atol=1e-5, rtol=0)
    explicit = model(input_ids=ids[:, :4], position_ids=torch.arange(2, 6)[None]).last_hidden_state[0]
    torch.testing.assert_close(explicit, alone[0], atol=1e-6, rtol=0)


def test_position_ids_below_the_offset_are_refused_and_the_length_limit_counts_the_offset():
    model = build(encoderstack.EncoderStackModel, **ROBERTA)
    with pytest.raises(ValueError, match=r"`position_ids` must lie in \[2, 63\], got values from 0 to 3"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long) + 2, position_ids=torch.arange(4)[None])
    with pytest.raises(ValueError, match="Sequence length 63 exceeds the 62 learned positions"):
        model(input_ids=torch.full((1, 63), 5))


def test_without_token_types_the_model_has_no_table_and_ignores_them_as_its_families_classes_do():
    """DistilBERT's, GTE's and ModernBERT's classes ignore the token types a BERT tokenizer gives a sentence pair."""
    model = build(encoderstack.EncoderStackModel, type_vocab_size=0)
    assert model.embeddings.token_type_embeddings is None
    inputs = batch()
    types = inputs.pop("token_type_ids")
    assert types.max() == 1
    for given in (torch.zeros_like(types), types):
        torch.testing.assert_close(
            model(**inputs, token_type_ids=given).last_hidden_state, model(**inputs).last_hidden_state, atol=0, rtol=0
        )


def test_with_one_token_type_a_second_is_refused_by_name():
    model = build(encoderstack.EncoderStackModel, **ROBERTA)
    inputs = batch()
    inputs["input_ids"] = inputs["input_ids"].clamp(min=2)  # no real token at the pad id
    with pytest.raises(ValueError, match=r"`token_type_ids` must lie in \[0, 0\], got values from 0 to 1"):
        model(**inputs)


def test_a_narrower_embedding_is_projected_and_the_masked_lm_head_predicts_at_its_width():
    model = build(encoderstack.EncoderStackForMaskedLM, embedding_size=16)
    assert model.model.embeddings.word_embeddings.weight.shape == (99, 16)
    assert model.model.embeddings.project.weight.shape == (32, 16)
    assert model.lm_head.dense.weight.shape == (16, 32) and model.lm_head.decoder.weight.shape == (99, 16)
    assert model.lm_head.decoder.weight is model.model.embeddings.word_embeddings.weight
    inputs = batch()
    padded = model(**inputs, padding_free=False).logits
    free = model(**inputs).logits
    mask = inputs["attention_mask"].bool()
    torch.testing.assert_close(free[mask], padded[mask], atol=1e-5, rtol=0)
    embeds = model.model.embeddings.word_embeddings(inputs["input_ids"])
    from_embeds = model(
        inputs_embeds=embeds, attention_mask=inputs["attention_mask"], token_type_ids=inputs["token_type_ids"]
    )
    torch.testing.assert_close(from_embeds.logits[mask], free[mask], atol=1e-5, rtol=0)


LAYOUT_PARTS = {  # layout -> (sequence classification, multiple choice): the activation on the first token or pooler
    "bert": ("pooler", "pooler"),
    "roberta": ("tanh", "pooler"),
    "electra": ("gelu", "gelu"),
    "distilbert": ("relu", "relu"),
    "deberta": ("gelu", "gelu"),  # DeBERTa's ContextPooler
}


@pytest.mark.parametrize("layout", LAYOUT_PARTS)
def test_each_head_layout_builds_its_sequence_heads_from_its_row_of_parts(layout):
    for model_class, expected in zip(
        (encoderstack.EncoderStackForSequenceClassification, encoderstack.EncoderStackForMultipleChoice),
        LAYOUT_PARTS[layout],
    ):
        model = build(model_class, head_layout=layout)
        assert (model.model.pooler is not None) == (expected == "pooler")
        assert hasattr(model, "pre_classifier") == (expected != "pooler")
        if expected != "pooler":
            first = torch.randn(2, 32)
            expected_features = encoderstack.modeling_encoderstack.ACT2FN[expected](model.pre_classifier(first))
            torch.testing.assert_close(model.pre_classifier_act(model.pre_classifier(first)), expected_features)


@pytest.mark.parametrize("model_class", HEADS, ids=lambda c: c.__name__)
def test_every_head_of_the_roberta_layout_agrees_between_padded_and_padding_free(model_class):
    model = build(model_class, **ROBERTA)
    inputs = head_inputs(model_class, {k: v for k, v in batch().items() if k != "token_type_ids"})
    padded, free = (model(**inputs, padding_free=flag) for flag in (False, True))
    mask = inputs["attention_mask"].reshape(-1, inputs["attention_mask"].shape[-1]).bool()
    for name in ("logits", "prediction_logits", "start_logits", "last_hidden_state", "seq_relationship_logits"):
        if getattr(padded, name, None) is not None:
            a, b = getattr(padded, name), getattr(free, name)
            if a.dim() >= 2 and a.shape[:2] == mask.shape:
                a, b = a[mask], b[mask]
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("layout", ["electra", "distilbert"])
def test_a_layout_without_a_pooler_refuses_the_next_sentence_pre_training_head_and_names_electras(layout):
    with pytest.raises(ValueError, match="is EncoderStackForReplacedTokenDetection"):
        build(encoderstack.EncoderStackForPreTraining, head_layout=layout)
    assert build(encoderstack.EncoderStackModel, head_layout=layout).pooler is None


def test_the_replaced_token_detector_scores_every_token_and_its_loss_counts_real_tokens_only():
    model = build(encoderstack.EncoderStackForReplacedTokenDetection, head_layout="electra", embedding_size=16)
    inputs = batch()
    labels = torch.randint(0, 2, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(4))
    out = model(**inputs, labels=labels)
    real = inputs["attention_mask"].bool()
    expected = torch.nn.functional.binary_cross_entropy_with_logits(out.logits[real], labels[real].float())
    torch.testing.assert_close(out.loss, expected)
    padded = model(**inputs, labels=labels, padding_free=False)
    torch.testing.assert_close(padded.logits[real], out.logits[real], atol=1e-5, rtol=0)


MPNET_LIKE = {"position_offset": 2, "pad_token_id": 1, "type_vocab_size": 0, "relative_attention": "bias"}


@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (10, 20)])
def test_relative_position_buckets_equal_mpnets_at_every_distance_through_the_max_distance_edge(
    num_buckets, max_distance
):
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    from encoderstack.modeling_encoderstack import relative_position_bucket

    distance = torch.arange(-3 * max_distance, 3 * max_distance + 1)[None, :]
    expected = MPNetEncoder.relative_position_bucket(distance, num_buckets=num_buckets, max_distance=max_distance)
    assert torch.equal(relative_position_bucket(distance, num_buckets, max_distance), expected)
    # every bucket is reached (but `num_buckets // 2`, distance 0 after the query), so the range spans both edges
    assert expected.unique().numel() == num_buckets - 1


def relative_bias_model():
    """An MPNet-like model whose relative-position bias is large enough to dominate the scores."""
    model = build(encoderstack.EncoderStackModel, **MPNET_LIKE)
    with torch.no_grad():
        model.relative_attention.bias.weight.normal_(0, 2.0)
    return model


DEBERTA_LIKE = {
    "type_vocab_size": 0,
    "position_embedding_type": None,
    "relative_attention": "disentangled",
    "position_buckets": 8,
    "max_relative_positions": 16,
    "pos_att_type": ["c2p", "p2c"],
    "share_att_key": True,
    "norm_rel_ebd": "layer_norm",
    "head_layout": "deberta",
}


def disentangled_model():
    """A DeBERTa-v3-like model (no positions but the relative ones) whose c2p and p2c terms are large: its relative
    embeddings, queries and keys scaled up, and the attention's output, so that it moves the hidden states."""
    model = build(encoderstack.EncoderStackModel, **DEBERTA_LIKE)
    with torch.no_grad():
        model.relative_attention.norm.weight.normal_(0, 4.0)
        for layer in model.layers:
            layer.attention.query.weight.mul_(8.0)
            layer.attention.key.weight.mul_(8.0)
            layer.attention.output.weight.mul_(8.0)
    return model


def scramble(model):
    """Every relative term of `model` made different: MPNet's bias zeroed, DeBERTa's embeddings reversed."""
    with torch.no_grad():
        if model.config.relative_attention == "bias":
            model.relative_attention.bias.weight.zero_()
        else:
            model.relative_attention.embeddings.weight.copy_(model.relative_attention.embeddings.weight.flip(0))


RELATIVE_MODELS = {"bias": relative_bias_model, "disentangled": disentangled_model}


def each_alone(model, seqs):
    with torch.no_grad():
        return torch.cat([model(input_ids=s[None]).last_hidden_state[0] for s in seqs])


RELATIVE_LENGTHS = (40, 9, 23, 3)  # distances past the exact buckets into the logarithmic ones


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("layout", ["right", "left", "flattened"])
@pytest.mark.parametrize("term", RELATIVE_MODELS)
def test_the_relative_term_reaches_every_path_from_each_sequences_own_distances(term, backend, padding_free, layout):
    """Each sequence gets what it gets alone, whether it is padded on either side (its distances, not the row's
    padding, decide its term: MPNet's bias, or DeBERTa's c2p and p2c from its own queries and keys), packed with the
    others, or flattened into one row (per sequence, or under a block-diagonal mask); and the term matters: with
    other relative weights the outputs differ."""
    model = RELATIVE_MODELS[term]()
    model.set_attn_implementation(backend)
    generator = torch.Generator().manual_seed(4)
    seqs = [torch.randint(2, 99, (n,), generator=generator) for n in RELATIVE_LENGTHS]
    expected = each_alone(model, seqs)
    if layout == "flattened":
        inputs = {
            "input_ids": torch.cat(seqs)[None],
            "position_ids": torch.cat([torch.arange(n) for n in RELATIVE_LENGTHS])[None] + 2,
        }
        real_tokens = torch.ones(1, sum(RELATIVE_LENGTHS), dtype=torch.bool)
    else:
        width = max(RELATIVE_LENGTHS)
        real_tokens = torch.arange(width) < torch.tensor(RELATIVE_LENGTHS)[:, None]
        if layout == "left":
            real_tokens = real_tokens.flip(-1)
        ids = torch.ones(len(seqs), width, dtype=torch.long)
        ids[real_tokens] = torch.cat(seqs)
        inputs = {"input_ids": ids, "attention_mask": real_tokens.long()}
    with torch.no_grad():
        plan = model.execution_plan(**inputs, padding_free=padding_free)
        got = model(**inputs, padding_free=padding_free).last_hidden_state[real_tokens]
    assert (
        plan.kind
        == {True: "per_sequence", False: "block_diagonal" if layout == "flattened" else "padded"}[padding_free]
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    scramble(model)
    assert not torch.allclose(each_alone(model, seqs), expected, atol=1e-2)


@pytest.mark.parametrize(("buckets", "reach"), [(256, 512), (8, 16), (4, 6), (32, 100)])
def test_debertas_log_buckets_and_rows_equal_its_own_at_every_distance_through_both_edges(buckets, reach):
    """`make_log_bucket_position` at every distance from far before to far after the reach, and each query-key pair's
    row of the relative embeddings as DeBERTa's c2p gathers it, for the whole table (as a compiled forward reads it)
    and for the rows a short forward keeps."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position, make_log_bucket_position

    from encoderstack.modeling_encoderstack import DisentangledPositions, log_bucket_position

    distance = torch.arange(-3 * reach, 3 * reach + 1)
    expected = make_log_bucket_position(distance, buckets, reach)
    assert torch.equal(log_bucket_position(distance, buckets, reach), expected.long())
    rows = (expected + buckets).clamp(0, 2 * buckets - 1)
    assert (rows.min(), rows.max()) == (0, 2 * buckets - 1)  # both edges are crossed
    config = encoderstack.EncoderStackConfig(
        **{**DEBERTA_LIKE, "position_buckets": buckets, "max_relative_positions": reach}, hidden_size=8,
        num_attention_heads=2, max_position_embeddings=4 * reach,
    )  # fmt: skip
    positions = DisentangledPositions(config)
    for length in (1, 2, buckets // 2 + 1, 3 * reach):
        query = torch.zeros(1, length, 1)
        rows = build_relative_position(query, query, bucket_size=buckets, max_position=reach)[0]
        rows = (rows + buckets).clamp(0, 2 * buckets - 1)
        table = positions.embeddings.weight
        kept = positions(length, torch.float32)
        torch.testing.assert_close(kept.embeddings[kept.index], positions.norm(table)[rows])
        with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
            whole = positions(length, torch.float32)
        assert torch.equal(whole.index, rows) and whole.embeddings.shape[0] == 2 * buckets


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pos_att_type": None}, r"needs `pos_att_type`, 'c2p' and/or 'p2c' once each, got \[\]"),
        ({"pos_att_type": ["c2p", "c2p"]}, "once each"),
        ({"position_buckets": 0}, "`position_buckets` must be a positive integer or None, got 0"),
        ({"position_buckets": 8, "max_relative_positions": 5}, r"`max_relative_positions` \(5\) must exceed the 5"),
        ({"num_key_value_heads": 2}, "grouped-query attention"),
    ],
)
def test_a_disentangled_config_that_cannot_run_is_refused_naming_the_field(fields, message):
    from huggingface_hub.errors import StrictDataclassClassValidationError as ValidationError

    with pytest.raises(ValidationError, match=message):
        encoderstack.EncoderStackConfig(**{**DEBERTA_LIKE, **fields})


def test_attention_bias_as_a_list_gives_a_bias_to_the_projections_it_names_only():
    """DeBERTa v1's: the query, value, output and position query projections have biases, the key and position key
    none; a name that is no projection is refused."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    named = ["query", "value", "output", "position_query"]
    fields = {**DEBERTA_LIKE, "share_att_key": False, "attention_bias": named}
    attention = build(encoderstack.EncoderStackModel, **fields).layers[0].attention
    for name in ("query", "key", "value", "output", "position_key", "position_query"):
        assert (getattr(attention, name).bias is not None) == (name in named), name
    with pytest.raises(StrictDataclassFieldValidationError, match="field 'attention_bias'"):
        encoderstack.EncoderStackConfig(attention_bias=["query", "keys"])


def test_recorded_attention_maps_hold_the_relative_bias():
    """The eager maps of a padded batch are the softmax of scores plus the bias, per head."""
    model = relative_bias_model()
    model.set_attn_implementation("eager")
    ids = torch.randint(2, 99, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        recorded = model(input_ids=ids, output_attentions=True).attentions[0]
        model.relative_attention.bias.weight.zero_()
        without = model(input_ids=ids, output_attentions=True).attentions[0]
    assert not torch.allclose(recorded, without, atol=1e-2)


def test_relative_attention_refuses_sliding_layers_and_too_few_buckets_by_name():
    from huggingface_hub.errors import StrictDataclassClassValidationError as ValidationError

    with pytest.raises(ValidationError, match="does not combine with sliding layers"):
        encoderstack.EncoderStackConfig(
            relative_attention="bias", num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
            sliding_window=4,
        )  # fmt: skip
    with pytest.raises(ValidationError, match="`relative_attention_num_buckets` must be at least 4.*got 2"):
        encoderstack.EncoderStackConfig(relative_attention="bias", relative_attention_num_buckets=2)
    with pytest.raises(ValidationError, match="`relative_attention_max_distance` must exceed the 8 distances"):
        encoderstack.EncoderStackConfig(relative_attention="bias", relative_attention_max_distance=8)


@pytest.mark.parametrize("backend", ["flex_attention", "flash_attention_2"])
def test_a_backend_that_takes_no_score_term_is_refused_by_name_rather_than_dropping_the_bias(backend):
    model = relative_bias_model()
    model.config._attn_implementation = backend  # flash cannot even be selected without its package
    with pytest.raises(ValueError, match=f"the {backend} backend cannot take: use one of eager, sdpa"):
        model(input_ids=torch.full((1, 5), 7))


def test_padding_between_real_tokens_is_refused_with_a_relative_term_whose_distances_it_would_blur():
    """The padded path would count the gap, the packed path would not: rather than two answers, one error."""
    model = relative_bias_model()
    ids = torch.full((2, 6), 7)
    gapped = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"`attention_mask` has 1 row\(s\) with padding between real tokens"):
        model(input_ids=ids, attention_mask=gapped)
    model(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]))  # either side: fine
    build(encoderstack.EncoderStackModel)(input_ids=ids, attention_mask=gapped)  # without the term: as before


def test_the_albert_layout_pre_trains_on_sentence_order_under_albert_s_names():
    """The same 2-way head on the pooled output as BERT's next sentence, stored as `sentence_order`, taking ALBERT's
    `sentence_order_label` and giving `sop_logits`; the loss is the masked-LM loss plus its cross-entropy."""
    model = build(encoderstack.EncoderStackForPreTraining, head_layout="albert", embedding_size=16)
    bert = build(encoderstack.EncoderStackForPreTraining)
    assert {key for key in model.state_dict() if not key.startswith(("model.", "lm_head."))} == {
        "sentence_order.weight",
        "sentence_order.bias",
    }
    assert {key for key in bert.state_dict() if not key.startswith(("model.", "lm_head."))} == {
        "next_sentence.weight",
        "next_sentence.bias",
    }
    inputs = batch()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    order = torch.tensor([0, 1, 1])
    out = model(**inputs, labels=labels, sentence_order_label=order)
    assert out.seq_relationship_logits is None and out.sop_logits.shape == (3, 2)
    mask = inputs["attention_mask"].bool()
    mlm = torch.nn.functional.cross_entropy(out.prediction_logits[mask], labels[mask])
    expected = mlm + torch.nn.functional.cross_entropy(out.sop_logits, order)
    torch.testing.assert_close(out.loss, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(model(**inputs, labels=labels, next_sentence_label=order).loss, out.loss)
    assert bert(**inputs).sop_logits is None
