"""Prompt data: DAPO-schema files, chat templating, the sampling order, the synthetic math task, held-out splits."""

import json
import logging
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import save_with_tokenizer  # noqa: E402

from megatron_dapo.data.held_out_split import problem_key, split_held_out  # noqa: E402
from megatron_dapo.data.prompt_encoding import encode_prompt, raw_prompt_text  # noqa: E402
from megatron_dapo.data.prompt_file import (  # noqa: E402
    DataError,
    PromptRow,
    drop_duplicate_rows,
    load_prompt_rows,
    write_rows,
)
from megatron_dapo.data.prompt_sampler import PromptSampler  # noqa: E402
from megatron_dapo.data.synthetic_math import DAPO_INSTRUCTION, generate_rows  # noqa: E402

# DAPO-Math-17K's parquet schema, nested types and all.
MESSAGE = pa.struct([("content", pa.string()), ("role", pa.string())])
DAPO_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(MESSAGE)),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string())])),
])


def dapo_row(problem, truth, index):
    return {"data_source": "math_dapo",
            "prompt": [{"content": DAPO_INSTRUCTION.format(problem=problem), "role": "user"}], "ability": "MATH", "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


GOOD = [dapo_row("What is $2^{10}$?", "1024", "a1"), dapo_row("Solve $x^2=9$, $x>0$.", "3", "b2"),
        dapo_row("Simplify $\\frac{6}{8}$.", "\\frac{3}{4}", "c3")]


# ---- files -------------------------------------------------------------------------------------------------------

def test_parquet_in_the_dapo_schema_reads_back(tmp_path):
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(GOOD, schema=DAPO_SCHEMA), path)
    rows, skipped = load_prompt_rows(path)
    assert skipped == 0
    assert rows == [PromptRow(prompt=r["prompt"], ground_truth=r["reward_model"]["ground_truth"],
                              data_source="math_dapo", extra_info=r["extra_info"], row_index=i)
                    for i, r in enumerate(GOOD)]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_write_rows_round_trip(tmp_path, suffix):
    rows = generate_rows(20, seed=3, operations="+-*", num_operands=3, steps=True)
    path = tmp_path / f"sub/train{suffix}"
    write_rows(path, rows)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    loaded, skipped = load_prompt_rows(path)
    assert skipped == 0
    assert [(r.prompt, r.ground_truth, r.data_source, r.extra_info, r.row_index) for r in loaded] == \
           [(r["prompt"], r["reward_model"]["ground_truth"], r["data_source"], r["extra_info"], i)
            for i, r in enumerate(rows)]
    if suffix == ".parquet":  # nested types, as the real dataset, not JSON strings
        schema = pq.read_schema(path)
        assert pa.types.is_list(schema.field("prompt").type)
        assert pa.types.is_struct(schema.field("reward_model").type)


def test_message_keys_only_some_rows_have_are_not_invented(tmp_path):
    named = {**GOOD[1], "prompt": [{"role": "system", "content": "Be brief.", "name": "judge"}, *GOOD[1]["prompt"]]}
    path = tmp_path / "named.parquet"
    write_rows(path, [GOOD[0], named])  # parquet gives every message the struct's keys: "name" is null in GOOD[0]
    rows, _ = load_prompt_rows(path)
    assert [r.prompt for r in rows] == [GOOD[0]["prompt"], named["prompt"]]


BAD = [
    ({**GOOD[0], "prompt": None}, "prompt"),
    ({**GOOD[0], "prompt": []}, "prompt"),
    ({**GOOD[0], "prompt": [{"content": "  ", "role": "user"}]}, "prompt"),
    ({**GOOD[0], "reward_model": {"ground_truth": None, "style": "x"}}, "ground_truth"),
    ({**GOOD[0], "reward_model": {"ground_truth": " ", "style": "x"}}, "ground_truth"),
    ({**GOOD[0], "reward_model": None}, "ground_truth"),
]


def test_bad_parquet_rows_are_counted_and_skipped_with_one_warning(tmp_path, caplog):
    records = [GOOD[0], BAD[0][0], GOOD[1], *[b for b, _ in BAD[1:]], GOOD[2]]
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(records, schema=DAPO_SCHEMA), path)
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.data.prompt_file"):
        rows, skipped = load_prompt_rows(path)
    assert skipped == len(BAD)
    assert [r.row_index for r in rows] == [0, 2, 8]
    assert [r.ground_truth for r in rows] == ["1024", "3", "\\frac{3}{4}"]
    [warning] = caplog.records
    message = warning.getMessage()
    assert str(path) in message and "skipped 6 of 9 rows" in message
    assert "rows 1 (missing or empty prompt), 3 (" in message and "and 1 more" in message


def test_bad_jsonl_lines_are_counted_and_skipped(tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(GOOD[0]), "{not json", "", json.dumps([1, 2]), json.dumps(BAD[3][0]),
             json.dumps({**GOOD[1], "prompt": "What is 1+1?", "reward_model": {"ground_truth": 2}})]
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.data.prompt_file"):
        rows, skipped = load_prompt_rows(path)
    assert skipped == 3  # the blank line is not a row
    assert [r.row_index for r in rows] == [0, 5]
    # A bare string prompt is one user message; a numeric ground truth becomes its text.
    assert rows[1].prompt == [{"role": "user", "content": "What is 1+1?"}] and rows[1].ground_truth == "2"
    [warning] = caplog.records
    assert "skipped 3 of 5 rows" in warning.getMessage() and "1 (invalid JSON" in warning.getMessage()


def test_duplicate_problems_are_dropped_in_file_order():
    def row(text, truth, i):
        return PromptRow([{"role": "user", "content": text}], truth, row_index=i)

    rows = [row("1+1?", "2", 0), row("2+2?", "4", 1), row("1+1?", "2", 2), row("1+1?", "3", 3), row("2+2?", "4", 4)]
    kept = drop_duplicate_rows(rows)
    assert [r.row_index for r in kept] == [0, 1, 3]  # same prompt, other answer: a different problem
    assert drop_duplicate_rows(kept) == kept


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match=r"missing\.parquet: no such prompt file"):
        load_prompt_rows(tmp_path / "missing.parquet")
    (tmp_path / "rows.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"rows\.csv: unknown prompt file type '\.csv'; use one of \.parquet, \.jsonl"):
        load_prompt_rows(tmp_path / "rows.csv")
    (tmp_path / "fake.parquet").write_text("this is not parquet")
    with pytest.raises(DataError, match=r"fake\.parquet: not a readable parquet file"):
        load_prompt_rows(tmp_path / "fake.parquet")
    write_rows(tmp_path / "good.parquet", generate_rows(8000, seed=0, style="dapo"))
    data = bytearray((tmp_path / "good.parquet").read_bytes())
    (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
    with pytest.raises(DataError, match=r"cut\.parquet: not a readable parquet file .*footer"):
        load_prompt_rows(tmp_path / "cut.parquet")
    for i in range(len(data) // 2, len(data) // 2 + 1000):  # damage the data pages, not the footer
        data[i] ^= 0x5A
    (tmp_path / "damaged.parquet").write_bytes(data)
    with pytest.raises(DataError, match=r"damaged\.parquet: unreadable after row \d+"):
        load_prompt_rows(tmp_path / "damaged.parquet")
    pq.write_table(pa.table({"prompt": ["hi"], "answer": ["1"]}), tmp_path / "other.parquet")
    with pytest.raises(DataError, match=r"other\.parquet: no column 'reward_model'"):
        load_prompt_rows(tmp_path / "other.parquet")
    pq.write_table(pa.Table.from_pylist([b for b, _ in BAD], schema=DAPO_SCHEMA), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: no usable rows out of 6; row 0: missing or empty prompt"):
        load_prompt_rows(tmp_path / "bad.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no usable rows out of 0"):
        load_prompt_rows(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match=r"out\.json: unknown prompt file type"):
        write_rows(tmp_path / "out.json", GOOD)


# ---- chat templating ---------------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return save_with_tokenizer(tmp_path_factory.mktemp("tok"))


def test_chat_template_encodes_the_conversation_and_the_assistant_header(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 plus 4?"}]
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        ids = encode_prompt(tokenizer, messages)
    finally:
        tokenizer.chat_template = None
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens, not their spelling


def test_raw_prompt_and_the_missing_template_error(tokenizer):
    messages = [{"role": "user", "content": "12+7="}]
    with pytest.raises(DataError, match=r"has no chat template: set one .* or use the raw prompt option"):
        encode_prompt(tokenizer, messages)
    ids = encode_prompt(tokenizer, messages, raw_prompt=True)
    assert ids == tokenizer.encode("12+7=") and tokenizer.decode(ids) == "12+7="
    assert raw_prompt_text([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb"


# ---- sampling order ----------------------------------------------------------------------------------------------

def draw(sampler, sizes):
    return [i for k in sizes for i in sampler.next_indices(k)]


def test_sampler_epochs_are_seeded_permutations_whatever_the_draw_sizes():
    n = 23
    order = PromptSampler(n, seed=5).next_indices(3 * n)
    assert order == draw(PromptSampler(n, seed=5), [1, 7, 0, 30, 4, 27])
    epochs = [order[e * n:(e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # reshuffled every epoch
    assert PromptSampler(n, seed=6).next_indices(n) != epochs[0]
    sampler = PromptSampler(n, seed=5)
    sampler.next_indices(n + 2)
    assert (sampler.epoch, sampler.position, sampler.consumed) == (1, 2, n + 2)


@pytest.mark.parametrize("dp_size", [1, 3])
def test_sampler_resumes_exactly(dp_size):
    n = 20
    for rank in range(dp_size):
        reference = PromptSampler(n, seed=9, dp_rank=rank, dp_size=dp_size)
        first = reference.next_indices(5)
        state = json.loads(json.dumps(reference.state_dict()))  # survives a JSON checkpoint
        expected = draw(reference, [4, 11, 2])  # runs over an epoch boundary
        resumed = PromptSampler(n, seed=9, dp_rank=rank, dp_size=dp_size)
        resumed.load_state_dict(state)
        assert draw(resumed, [4, 11, 2]) == expected
        assert first + expected == PromptSampler(n, seed=9, dp_rank=rank, dp_size=dp_size).next_indices(22)


def test_dp_ranks_get_disjoint_equal_shares():
    n, dp = 26, 4
    samplers = [PromptSampler(n, seed=1, dp_rank=r, dp_size=dp) for r in range(dp)]
    for _ in range(2):  # two epochs
        shares = [s.next_indices(n // dp) for s in samplers]
        flat = [i for share in shares for i in share]
        assert len(flat) == len(set(flat)) == dp * (n // dp)
        assert all(s.position == 0 for s in samplers)  # every rank finished the epoch together


def test_sampler_bad_arguments_and_mismatched_state():
    with pytest.raises(DataError, match="num_rows: must be a whole number >= 1, got 0"):
        PromptSampler(0, seed=1)
    with pytest.raises(DataError, match="dp_rank: must be < dp_size = 2, got 2"):
        PromptSampler(10, seed=1, dp_rank=2, dp_size=2)
    with pytest.raises(DataError, match="3 rows cannot be shared by 4 data-parallel ranks"):
        PromptSampler(3, seed=1, dp_size=4)
    with pytest.raises(DataError, match="k: must be a whole number >= 0"):
        PromptSampler(10, seed=1).next_indices(-1)
    state = PromptSampler(10, seed=1).state_dict()
    with pytest.raises(DataError, match="saved with num_rows=10 but this sampler has num_rows=11"):
        PromptSampler(11, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="saved with dp_size=1 but this sampler has dp_size=2"):
        PromptSampler(10, seed=1, dp_size=2).load_state_dict(state)


# ---- synthetic math ----------------------------------------------------------------------------------------------

def independent_value(expression: str) -> int:
    assert re.fullmatch(r"\d+([-+*]\d+)*", expression), expression
    return eval(expression)  # only digits and + - *: Python's own precedence is the reference


@pytest.mark.parametrize("knobs", [dict(digits=1), dict(digits=3, operations="+-*", num_operands=4),
                                   dict(digits=2, operations="*", num_operands=3, steps=True),
                                   dict(digits=1, operations="+", num_operands=(2, 12), steps=True)])
def test_synthetic_rows_are_deterministic_and_correct(knobs):
    rows = generate_rows(200, seed=11, **knobs)
    assert rows == generate_rows(200, seed=11, **knobs)
    assert rows[:50] == generate_rows(50, seed=11, **knobs)
    assert rows != generate_rows(200, seed=12, **knobs)
    for row in rows:
        [message] = row["prompt"]
        expression = message["content"].removesuffix("=")
        operands = [int(x) for x in re.split(r"[-+*]", expression)]
        low, high = (lambda n: n if isinstance(n, tuple) else (n, n))(knobs.get("num_operands", 2))
        assert low <= len(operands) <= high and max(operands) < 10 ** knobs["digits"]
        assert set(re.sub(r"\d", "", expression)) <= set(knobs.get("operations", "+-"))
        answer = str(independent_value(expression))
        assert row["reward_model"]["ground_truth"] == answer
        solution = row["extra_info"]["solution"].split("\n")
        assert solution[-1] == f"Answer: {answer}"
        for step in solution[:-1]:  # the working: each line is a true equation
            left, right = step.split("=")
            assert independent_value(left) == int(right)
        assert len(solution) == (len(operands) if knobs.get("steps") else 1)
    if isinstance(knobs.get("num_operands"), tuple):  # every count of the range, ends included
        counts = {len(re.split(r"[-+*]", r["extra_info"]["expression"])) for r in rows}
        assert counts == set(range(knobs["num_operands"][0], knobs["num_operands"][1] + 1))


def test_dapo_style_prompt():
    [short] = generate_rows(1, seed=4, operations="+-*", num_operands=3)
    [long] = generate_rows(1, seed=4, operations="+-*", num_operands=3, style="dapo")
    problem = re.search(r"\n\nWhat is (.*)\?\n\n", long["prompt"][0]["content"]).group(1)
    assert long["prompt"][0]["content"] == DAPO_INSTRUCTION.format(problem=f"What is {problem}?")
    assert problem.replace(" ", "") + "=" == short["prompt"][0]["content"]
    assert long["reward_model"] == short["reward_model"]


def test_synthetic_bad_knobs():
    for knobs, message in [(dict(digits=0), "digits: must be a whole number >= 1"),
                           (dict(digits=10), "digits: at most 9"),
                           (dict(operations="+/"), "operations: a non-empty string of '\\+-\\*'"),
                           (dict(num_operands=1), "num_operands: a whole number >= 2, or a range"),
                           (dict(num_operands=(5, 4)), r"num_operands: .* 2 <= low <= high, got \(5, 4\)"),
                           (dict(num_operands=[2, 4]), r"num_operands: .* got \[2, 4\]"),
                           (dict(style="long"), "style: one of")]:
        with pytest.raises(DataError, match=message):
            generate_rows(5, seed=0, **knobs)


def test_held_out_split_shares_no_problem():
    rows = generate_rows(300, seed=2, digits=1, operations="+")  # at most 100 distinct problems: many duplicates
    train, held_out = split_held_out(rows, num_eval=30, seed=7)
    eval_keys = [problem_key(r) for r in held_out]
    assert len(held_out) == len(set(eval_keys)) == 30
    assert not set(eval_keys) & {problem_key(r) for r in train}
    assert len(train) == sum(problem_key(r) not in set(eval_keys) for r in rows)  # nothing else dropped
    assert (train, held_out) == split_held_out(rows, num_eval=30, seed=7)
    assert held_out != split_held_out(rows, num_eval=30, seed=8)[1]
    loaded = [PromptRow(prompt=r["prompt"], ground_truth="0") for r in rows]  # works on loaded rows too
    assert [problem_key(r) for r in split_held_out(loaded, num_eval=30, seed=7)[1]] == eval_keys
    distinct = len({problem_key(r) for r in rows})
    with pytest.raises(DataError, match=f"num_eval: must be a whole number from 1 to {distinct - 1}"):
        split_held_out(rows, num_eval=distinct, seed=7)


def test_prompts_longer_than_max_prompt_len_are_skipped_and_counted_never_cut(tokenizer, caplog):
    from megatron_dapo.config import ConfigError
    from megatron_dapo.data.prompt_file import PromptRow
    from megatron_dapo.data.prompt_sampler import PromptSampler
    from megatron_dapo.data.prompt_source import PromptSource

    texts = ["1+1=", "What is 3 plus 4? " * 6, "2+2=", "Divide 81 by 9 to get 9 " * 5, "3+3="]
    rows = [PromptRow([{"role": "user", "content": t}], str(i)) for i, t in enumerate(texts)]
    limit = 8
    fits = [len(tokenizer.encode(t)) <= limit for t in texts]
    assert fits == [True, False, True, False, True]

    def source():
        return PromptSource(rows, PromptSampler(len(rows), seed=1), tokenizer, max_prompt_len=limit, chat_template=False)

    src = source()
    with caplog.at_level("WARNING"):
        items = src.next_items(5)
    assert sum("longer than data.max_prompt_len" in r.message for r in caplog.records) == 1  # once, not per prompt
    assert [it.ground_truth for it in items] == [it.ground_truth for it in source().next_items(5)]  # deterministic
    assert len(items) == 5 and {it.index for it in items} <= {0, 2, 4}
    assert all(it.token_ids == tokenizer.encode(texts[it.index]) for it in items)  # whole prompts, uncut
    assert src.too_long >= 2
    with pytest.raises(ConfigError, match="data.max_prompt_len: every prompt of data.train_path is longer than 2"):
        PromptSource(rows, PromptSampler(len(rows), seed=1), tokenizer, max_prompt_len=2,
                     chat_template=False).next_items(1)
