"""The judges (halludetect/labels/judges/: the rule-based `match`, the `openai` judge against a local
fake endpoint, the registry) and the two-pass protocol: labels, drops, invalid verdicts that never
become labels; and the hostile cases of the judge stage, which fails when no reply is usable and
counts partial invalidity."""

import json

import polars as pl
import pytest
from support import KEY, label_inputs, qa_sample, stage

from halludetect.labels.judges import get_judge, label_distribution, two_pass
from halludetect.labels.judges.base import JudgeItem
from halludetect.labels.nli import get_nli
from halludetect.testing.fake_openai import FakeOpenAI, rule_responder


def test_match_judge_passes():
    judge = get_judge("match", lenient_recall=0.5)
    items = [JudgeItem("Q", "Smith did it.", ("John Smith",)), JudgeItem("Q", "John Smith did.", ("John Smith",))]
    strict = judge.judge(items, with_reference=True)
    lenient = judge.judge(items, with_reference=False)
    assert [v.verdict for v in strict] == ["no", "yes"]
    assert lenient[0].verdict == "yes"  # a near miss: the protocol will drop it


def test_unknown_backend_did_you_mean():
    with pytest.raises(KeyError, match="did you mean 'match'"):
        get_judge("mach")
    with pytest.raises(KeyError, match="valid: exact, hf, openai"):
        get_nli("deberta")


def _frames():
    questions = pl.DataFrame(
        {"id": ["q1", "q2"], "question": ["Who?", "Where?"], "answers": [["John Smith"], ["Paris"]]}
    )
    gens = pl.DataFrame(
        {
            "question_id": ["q1", "q1", "q1", "q2"],
            "sample_index": [0, 1, 2, 0],
            "split": ["val", "val", "val", "test"],
            "text": ["It was John Smith.", "Smith.", "Mary Jones.", "Paris."],
        }
    )
    return questions, gens


def test_two_pass_protocol_labels_and_drops():
    questions, gens = _frames()
    df = two_pass(get_judge("match"), questions, gens)
    got = {(r["question_id"], r["sample_index"]): (r["label"], r["kept"], r["reason"]) for r in df.to_dicts()}
    assert got[("q1", 0)] == (0, True, "correct")
    assert got[("q1", 1)] == (None, False, "inconsistent")  # wrong in pass 1, right in pass 2
    assert got[("q1", 2)] == (1, True, "hallucination")
    assert got[("q2", 0)] == (0, True, "correct")
    dist = label_distribution(df)
    assert dist["val"] == {
        "judged": 3,
        "kept": 2,
        "correct": 1,
        "hallucinated": 1,
        "hallucination_rate": 0.5,
        "dropped": {"inconsistent": 1},
    }


def test_invalid_verdicts_never_become_labels():
    class Broken:
        name = "broken"

        def judge(self, items, with_reference):
            from halludetect.labels.judges.base import Verdict

            return [Verdict("invalid", "garbled") for _ in items]

    questions, gens = _frames()
    df = two_pass(Broken(), questions, gens)
    assert df["label"].null_count() == df.height and not df["kept"].any()
    assert set(df["reason"]) == {"pass 1 invalid"}


# ------------------------------------------------------------------ the openai judge
def test_unparseable_replies_are_asked_again_then_counted_invalid_never_labels():
    def respond(body, n):
        prompt = body["messages"][0]["content"]
        if "Mary" in prompt:
            return "I cannot tell."  # never parseable
        if "Smith, John" in prompt and not srv.requests[:n].count(body):
            return "The proposed answer is plausible."  # first ask only
        return rule_responder({"Who?": ["John Smith"]})(body, n)

    questions = pl.DataFrame({"id": ["q1"], "question": ["Who?"], "answers": [["John Smith"]]})
    gens = pl.DataFrame(
        {
            "question_id": ["q1"] * 3,
            "sample_index": [0, 1, 2],
            "split": ["test"] * 3,
            "text": ["It was John Smith.", "Mary Jones.", "Smith, John"],
        }
    )
    with FakeOpenAI(respond) as srv:
        judge = get_judge("openai", model="m", base_url=srv.url, api_key_env=KEY, parse_retries=2)
        df = two_pass(judge, questions, gens)
    got = {r["sample_index"]: r for r in df.to_dicts()}
    assert got[0]["label"] == 0 and got[0]["reason"] == "correct"
    assert got[1]["pass1_verdict"] == "invalid" and got[1]["label"] is None and not got[1]["kept"]
    assert got[1]["pass1_raw"] == "I cannot tell."
    assert got[2]["pass1_verdict"] == "no"  # "Smith, John" is not contiguous "John Smith" ...
    assert got[2]["pass2_verdict"] == "yes" and got[2]["reason"] == "inconsistent"  # ... asked twice in pass 2
    assert judge.usage.invalid == 1 and judge.usage.unparseable == 3 + 2  # Mary 3 times, Smith once per pass


def test_openai_judge_matches_the_offline_judge_and_pass_2_has_no_references():
    questions = pl.DataFrame(
        {"id": ["q1", "q2"], "question": ["Who?", "Where?"], "answers": [["John Smith", "J. Smith"], ["Paris"]]}
    )
    gens = pl.DataFrame(
        {
            "question_id": ["q1", "q1", "q1", "q2"],
            "sample_index": [0, 1, 2, 0],
            "split": ["val", "val", "val", "test"],
            "text": ["It was John Smith.", "Smith.", "Mary Jones.", "Paris."],
        }
    )
    offline = two_pass(get_judge("match"), questions, gens)
    with FakeOpenAI(rule_responder({"Who?": ["John Smith", "J. Smith"], "Where?": ["Paris"]})) as srv:
        judge = get_judge("openai", model="m", base_url=srv.url, api_key_env=KEY)
        online = two_pass(judge, questions, gens)
        prompts = [b["messages"][0]["content"] for b in srv.requests]
    cols = ["question_id", "sample_index", "pass1_verdict", "pass2_verdict", "label", "kept", "reason"]
    assert online.select(cols).equals(offline.select(cols))
    pass1, pass2 = prompts[:4], prompts[4:]
    assert len(pass2) == 2  # only the answers wrong in pass 1 go to pass 2
    who = [p for p in pass1 if "question: Who?" in p]
    assert len(who) == 3 and all("expected answers to this question: John Smith; J. Smith." in p for p in who)
    assert all("expected" not in p and "own knowledge" in p for p in pass2)


# ------------------------------------------------ TruthfulQA: the judge sees the wrong answers
def truthful_questions() -> pl.DataFrame:
    """Question 0 of the TruthfulQA sample, through its loader (the real questions table)."""
    from halludetect.config import DatasetPreset, PrepareParams
    from halludetect.qa.datasets import prepare

    df, _ = prepare(DatasetPreset(loader="truthful_qa", path=qa_sample("truthful_qa.jsonl")), PrepareParams())
    return df.filter(pl.col("id") == "0")


TRUTHFUL_ANSWERS = [
    "Nothing happens to you.",  # a correct answer
    "You digest the watermelon seeds.",  # a listed falsehood that holds none of the true answers
    "You will not digest the watermelon seeds.",  # true: holds "You digest ..."? no, "will not" breaks it
    "You get sick and you die.",  # wrong, and no true answer in it
]


def truthful_generations(split: str) -> pl.DataFrame:
    n = len(TRUTHFUL_ANSWERS)
    return pl.DataFrame(
        {"question_id": ["0"] * n, "sample_index": list(range(n)), "split": [split] * n, "text": TRUTHFUL_ANSWERS}
    )


def test_match_judge_uses_truthful_qa_wrong_answers():
    questions = truthful_questions()
    df = two_pass(get_judge("match"), questions, truthful_generations(questions["split"][0]))
    assert df["label"].to_list() == [0, 1, 0, 1]
    assert df["pass1_raw"][1] == "contains the wrong answer 'You digest the watermelon seeds'"
    # without the wrong answers (the paper's datasets), "You digest the watermelon seeds" would go
    # to pass 2, where its recall of the true "You will not digest the watermelon seeds" passes
    plain = two_pass(get_judge("match"), questions.drop("incorrect_answers"), truthful_generations("val"))
    assert plain["reason"][1] == "inconsistent"


def test_openai_judge_prompt_for_truthful_qa_lists_true_and_wrong_answers_in_pass_1_only():
    questions = truthful_questions()
    with FakeOpenAI(rule_responder()) as srv:
        judge = get_judge("openai", model="m", base_url=srv.url, api_key_env=KEY)
        two_pass(judge, questions, truthful_generations(questions["split"][0]))
        prompts = [b["messages"][0]["content"] for b in srv.requests]
    pass1 = [p for p in prompts if "expected answers" in p]
    assert len(pass1) == len(TRUTHFUL_ANSWERS)
    for p in pass1:
        assert "expected answers to this question: The watermelon seeds pass through your digestive system; " in p
        assert "The following are incorrect answers to this question: You grow watermelons in your stomach; " in p
        assert "rather than any of the incorrect answers? Respond only with yes or no." in p
    pass2 = [p for p in prompts if p not in pass1]
    assert pass2 and all("incorrect" not in p and "own knowledge" in p for p in pass2)  # prompt 2 unchanged


# ------------------------------------------------------- the judge stage: all invalid (hostile)
@pytest.mark.hostile
def test_judge_stage_fails_when_every_reply_is_invalid_with_counts_and_where_to_look(tmp_path):
    with FakeOpenAI(lambda body, n: "I cannot tell.") as srv:
        args = label_inputs(tmp_path, srv.url)
        out, metrics = tmp_path / "j.parquet", tmp_path / "m.json"
        res = stage("stages.judge", *args, "--out", str(out), "--metrics", str(metrics))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        "error: judge: no usable label in 3 split(s):\n  train: 2 answers judged, none kept (pass 1 invalid: 2)\n"
        "  val: 6 answers judged, none kept (pass 1 invalid: 6)\n"
        "  test: 12 answers judged, none kept (pass 1 invalid: 12)\n"
        f"The judge's raw replies are in {out} (columns pass1_raw, pass2_raw)"
    ) in res.stderr
    assert set(pl.read_parquet(out)["pass1_raw"]) == {"I cannot tell."}  # kept for inspection


@pytest.mark.hostile
def test_judge_stage_succeeds_with_partial_invalidity_and_counts_it(tmp_path):
    rules = rule_responder()
    respond = lambda body, n: "I cannot tell." if "City3" in body["messages"][0]["content"] else rules(body, n)
    with FakeOpenAI(respond) as srv:
        args = label_inputs(tmp_path, srv.url)
        res = stage("stages.judge", *args, "--out", str(tmp_path / "j.parquet"), "--metrics", str(tmp_path / "m.json"))
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["invalid"]["pass1"] > 0 and all(s["kept"] > 0 for s in m["splits"].values())
    assert "invalid verdicts (dropped, never labels)" in res.stderr


@pytest.mark.hostile
def test_a_plugin_backend_named_like_a_key_of_its_section_gets_no_settings(monkeypatch):
    """Installed plugins named `two_pass` (a key of the judge section) and `equivalence` (one of the
    cluster section's) are built with no settings, not with that key's value (True, "paper")."""
    from importlib.metadata import EntryPoint, EntryPoints

    from halludetect.config import ClusterParams, JudgeParams
    from halludetect.core import registry
    from halludetect.labels.judges import judge_from
    from halludetect.labels.judges.match import MatchJudge
    from halludetect.labels.nli import nli_from
    from halludetect.labels.nli.backends import ExactNLI

    judges, nli = "halludetect.judges", "halludetect.nli"
    fake = {
        judges: EntryPoint("two_pass", "halludetect.labels.judges.match:MatchJudge", judges),
        nli: EntryPoint("equivalence", "halludetect.labels.nli.backends:ExactNLI", nli),
    }
    monkeypatch.setattr(registry, "installed", lambda group: EntryPoints([fake[group]] if group in fake else []))
    assert isinstance(judge_from(JudgeParams(backend="two_pass")), MatchJudge)
    assert isinstance(nli_from(ClusterParams(backend="equivalence")), ExactNLI)
    assert judge_from(JudgeParams(match={"lenient_recall": 0.75})).lenient_recall == 0.75  # a section still is
