"""runtime.documents: one reader for JSON/YAML files, typed field readers; runtime.vocab's enums in use."""

import dataclasses
import json

import pytest

from cost_models.memory import param_bytes
from planner.config import ConfigError, ParallelConfig
from runtime.documents import DocumentError, FieldError, Fields, parse_document, read_document, refuse_unknown_fields
from runtime.vocab import DType, RecomputeMode, Schedule, ShardRole, element_bytes


def test_read_document_names_the_file_for_every_failure(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(DocumentError, match=f"plan file {missing} does not exist; try again"):
        read_document(missing, "plan file", missing_hint="; try again")
    with pytest.raises(DocumentError, match="is a directory"):
        read_document(tmp_path, "plan file")
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"a": "\xe9"}')
    with pytest.raises(DocumentError, match=r"is not UTF-8 text \(byte 7\)"):
        read_document(latin, "plan file")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DocumentError, match="broken.json does not parse as JSON"):
        read_document(broken, "plan file")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(DocumentError, match=r"must hold an object \(a mapping of fields\), got list"):
        read_document(listed, "plan file")
    assert read_document(listed, "timeline file", top=(list, dict)) == [1, 2]


def test_read_document_raises_the_callers_error_and_reads_yaml(tmp_path):
    class PlanError(ValueError):
        pass

    with pytest.raises(PlanError, match="does not exist"):
        read_document(tmp_path / "x.json", "plan file", error=PlanError)
    cluster = tmp_path / "c.yaml"
    cluster.write_text("peak: 312e12\nname: a\n")
    assert read_document(cluster, "cluster file", yaml=True) == {"peak": 312e12, "name": "a"}
    other = tmp_path / "c.txt"
    other.write_text(json.dumps({"name": "b"}))
    assert read_document(other, "cluster file", yaml=True) == {"name": "b"}
    with pytest.raises(DocumentError, match="does not parse as YAML"):
        parse_document("a: [1", "cluster file c.yaml", suffix=".yaml")


def test_fields_name_the_document_and_the_dotted_field():
    f = Fields({"n": 4, "xs": {"a": 1}, "items": [{"k": "v"}, {"k": 3}]}, "build b.json")
    assert f.integer("n", minimum=1, maximum=4) == 4
    with pytest.raises(FieldError, match="build b.json: field 'n' must be <= 3, got 4"):
        f.integer("n", maximum=3)
    with pytest.raises(FieldError, match="field 'xs' must be a list, got dict"):
        f.items("xs")
    with pytest.raises(FieldError, match=r"field 'items\[1\].k' must be a string, got 3"):
        f.each("items", lambda g: g.text("k"))
    with pytest.raises(FieldError, match=r"field 'xs' has unknown key\(s\) \['a'\]; known: \['b'\]"):
        f.sub("xs").only(("b",))
    with pytest.raises(FieldError, match="field 'xs.b' is missing"):
        f.sub("xs").only(("a", "b"), ("b",))


def test_config_choices_are_the_vocabulary_and_stay_plain_strings():
    c = ParallelConfig(schedule=Schedule.GPIPE, recompute="full", dtype=DType.FP16)
    assert (c.schedule, c.recompute, c.dtype) == ("gpipe", RecomputeMode.FULL, "fp16")
    assert type(c.schedule) is str and type(ParallelConfig().dtype) is str  # reprs and generated code as before
    with pytest.raises(ConfigError, match="ParallelConfig.dtype='fp8' is not one of fp32, bf16, fp16"):
        ParallelConfig(dtype="fp8")
    assert param_bytes(DType.BF16, 0, 1).weights == DType.BF16.bytes == element_bytes("torch.bfloat16")
    assert [r for r in ShardRole if r.splits_output] == [ShardRole.COLUMN, ShardRole.COLUMN_OUT]


def test_every_settings_class_refuses_an_unknown_field_by_name_with_the_closest_known_one():
    """One check for every from_dict of a frozen settings class (the config, the build, an instruction, the
    optimizer, the schedule, the overlap): the unknown keys, the closest known field, and every known one."""
    from cost_models.overlap import Overlap
    from runtime.execute.lr_schedule import LrScheduleError, ScheduleSpec
    from runtime.execute.optim import OptimizerSpec
    from runtime.program.core import Instr, ProgramError
    from runtime.spec import SpecError, TrainSpec

    with pytest.raises(ConfigError, match=r"unknown ParallelConfig field\(s\) \['tensr'\] \(did you mean 'tensor'\?\)"):
        ParallelConfig.from_dict({"tensr": 2})
    for cls, doc, error in ((TrainSpec, {"clip_grads": 1.0}, SpecError), (Instr, {"opp": "F"}, ProgramError),
                            (OptimizerSpec, {"lr": 0.1, "wd": 0.1}, ValueError),
                            (ScheduleSpec, {"kind": "cosine", "warmup": 3}, LrScheduleError),
                            (Overlap, {"tp_com": 0.5}, ValueError)):
        with pytest.raises(error, match="unknown .* field") as e:
            cls.from_dict(doc)
        assert "known: [" in str(e.value), str(e.value)
    with pytest.raises(DocumentError, match=r"unknown thing field\(s\) \['zzz'\]; known: \['lr'\]"):
        refuse_unknown_fields({"zzz": 1}, _Settings, "thing")


@dataclasses.dataclass(frozen=True)
class _Settings:
    lr: float = 0.1
