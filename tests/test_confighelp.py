"""What ``--help`` reads: keys from YAML, meanings from config classes' docstrings."""

from dataclasses import dataclass, field

from rlinf_vla.confighelp import attribute_docs, class_keys, plain, section_keys, yaml_keys


@dataclass
class _Base:
    """A base.

    Attributes:
        shared: from the base. Its second sentence.
        overridden: the base's words.
    """

    shared: int = 1
    overridden: str = "x"


@dataclass
class _Child(_Base):
    """A child, with grouped headings as the policy configs write them.

    Per item, prose that is not an entry:

    - ``bullet``: a list item, not a field.

    Architecture (read from the checkpoint):
        width, depth: both described
            on two lines.
        low / high: the bounds.

    Sampling:
        overridden: the child's words.
        flag: ``True`` turns it on (see :class:`~rlinf_vla.config.ConfigError`).
    """

    width: int = 4
    depth: int = 2
    low: float = 0.0
    high: float | None = None
    flag: bool = False
    sizes: list[int] = field(default_factory=lambda: [1, 2])
    nothing: str = ""


def test_attribute_docs_read_every_heading_along_the_bases():
    docs = attribute_docs(_Child)
    assert docs["shared"] == "from the base. Its second sentence."
    assert docs["overridden"] == "the child's words."
    assert docs["width"] == docs["depth"] == "both described on two lines."
    assert docs["low"] == docs["high"] == "the bounds."
    assert "bullet" not in docs
    assert "sizes" not in docs


def test_plain_drops_markup_and_keeps_the_first_sentence():
    assert plain("from the base. Its second sentence.") == "from the base"
    assert plain("``True`` turns it on (see :class:`~a.b.ConfigError`).") == (
        "True turns it on (see ConfigError)"
    )
    assert plain("e.g. ``X`` is kept. Not this.") == "e.g. X is kept"
    long = plain("word " * 40)
    assert long.endswith(" ...") and len(long) <= 115


def test_class_keys_show_defaults_as_the_command_line_writes_them():
    keys = {k.name: k for k in class_keys(_Child, "sec", {"depth": 9}, skip=frozenset({"low"}))}
    assert "sec.low" not in keys
    assert keys["sec.depth"].default == "9"  # the given default wins over the class's
    assert keys["sec.high"].default == "null"
    assert keys["sec.flag"].default == "false"
    assert keys["sec.sizes"].default == "[1, 2]"
    assert keys["sec.nothing"].default == '""'
    assert keys["sec.flag"].line() == "  sec.flag = false  (True turns it on (see ConfigError))"


def test_yaml_keys_follow_nesting_and_skip_the_defaults_list(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "defaults:\n  - env: toy   # a group\n  - _self_\n"
        "name: demo\nrunner:\n  seed: 0      # the seed\n  logging:\n    wandb: false\n"
    )
    keys = [(k.name, k.default, k.meaning) for k in yaml_keys(f, "p.")]
    assert keys == [
        ("p.name", "demo", ""),
        ("p.runner", "", ""),
        ("p.runner.seed", "0", "the seed"),
        ("p.runner.logging", "", ""),
        ("p.runner.logging.wandb", "false", ""),
    ]


def test_section_keys_list_the_file_first_then_the_class_fields_it_leaves_out(tmp_path):
    f = tmp_path / "child.yaml"
    f.write_text("name: child\nwidth: 8   # wider\nlow: 1.0\n")
    keys = section_keys(f, "sec", _Child)
    names = [k.name for k in keys]
    assert names[:2] == ["sec.width", "sec.low"]  # the group choice sets name: not a key
    assert "sec.name" not in names and names.count("sec.width") == 1
    by = {k.name: k for k in keys}
    assert by["sec.width"].meaning == "wider"  # the YAML's comment wins
    assert by["sec.low"].meaning == "the bounds"  # else the class's
    assert by["sec.depth"].default == "2"
