"""Recipes: shipped files load and say how to run them; overrides win; bad keys, types and K tables name the key."""

import pathlib
import sys
import threading

import pytest
from omegaconf import OmegaConf

from rollout import SamplingParams
from rollout.cli.recipe import Recipe, load_recipe, recipe_dict, spec_config

RECIPES = pathlib.Path(__file__).resolve().parent.parent / "recipes"
SHIPPED = ("quickstart.yaml", "quickstart_suffix.yaml", "table.yaml", "gpu_hub.yaml")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_load_and_start_with_their_command(name):
    path = RECIPES / name
    lines = path.read_text().splitlines()
    header = [line for line in lines[: lines.index("")] if line.strip()]
    assert all(line.startswith("#") for line in header), "the file opens with a comment block"
    assert any(f"rollout run recipes/{name}" in line for line in header), "the comment gives the command"
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    assert recipe.output_dir.startswith("outputs/")


def test_shipped_recipes_cover_the_policies():
    draft = spec_config(load_recipe(RECIPES / "quickstart.yaml"))
    assert (draft.method, draft.model) == ("draft_model", "tiny-draft")
    suffix = spec_config(load_recipe(RECIPES / "quickstart_suffix.yaml"))
    assert (suffix.method, suffix.suffix_decoding_max_tree_depth) == ("suffix", 24)
    for name in ("quickstart.yaml", "quickstart_suffix.yaml"):  # the task's longest solutions fit
        assert load_recipe(RECIPES / name).sampling.max_new_tokens >= 700
    table = load_recipe(RECIPES / "table.yaml")
    spec = spec_config(table)
    assert spec.num_speculative_tokens_per_batch_size == [[1, 64, 3], [65, 128, 1], [129, 512, 0]]
    assert spec.num_speculative_tokens_per_batch_size[-1][1] >= table.rollout.max_batch_size
    gpu = load_recipe(RECIPES / "gpu_hub.yaml")
    assert gpu.model.device == "cuda" and gpu.data.chat_template and gpu.rewards[0].name == "gsm8k"


def test_overrides_win_over_the_file():
    recipe = load_recipe(
        RECIPES / "quickstart.yaml", ["sampling.n=8", "spec.method=null", "data.template='Q: {prompt}'"]
    )
    assert recipe.sampling.n == 8 and isinstance(recipe.sampling, SamplingParams)
    assert spec_config(recipe) is None
    assert recipe.data.template == "Q: {prompt}"
    table = load_recipe(RECIPES / "quickstart.yaml", ["spec.num_speculative_tokens_per_batch_size=[[1,64,2]]"])
    assert spec_config(table).num_speculative_tokens_per_batch_size == [[1, 64, 2]]
    rewards = load_recipe(None, ["rewards=[{name: arithmetic, weight: 2}, {name: 'mod:fn'}]"]).rewards
    assert [(r.name, r.weight) for r in rewards] == [("arithmetic", 2.0), ("mod:fn", 1.0)]


def test_an_override_through_a_list_changes_that_load_only():
    # the defaults are built once and copied for each load: an override through a list (updated in place) must not
    # reach the next load
    assert [r.weight for r in load_recipe(None, ["rewards.0.weight=3"]).rewards] == [3.0]
    assert [(r.name, r.weight) for r in load_recipe().rewards] == [("arithmetic", 1.0)]
    assert load_recipe(None, ["sampling.n=7"]).sampling.n == 7 and load_recipe().sampling.n != 7


def test_recipes_loaded_from_threads_leave_the_shared_defaults_whole():
    # OmegaConf's deepcopy unhooks each child of the source from it while copying it: two threads copying the shared
    # defaults at once could restore the other's unhooked state, and leave the defaults' sections without a parent
    from rollout.cli.recipe import _defaults

    def load_many():
        for _ in range(30):
            assert load_recipe(None, ["sampling.n=3"]).sampling.n == 3

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so that a missing lock shows
    try:
        threads = [threading.Thread(target=load_many) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    defaults = _defaults()
    assert all(defaults._get_node(key)._get_parent() is defaults for key in defaults)


def test_resolved_config_loads_back_to_the_same_recipe(tmp_path):
    recipe = load_recipe(RECIPES / "table.yaml", ["sampling.seed=3"])
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(recipe_dict(recipe)), path)
    assert load_recipe(path) == recipe


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.nme=x"], r"model\.nme: Key 'nme' not in 'ModelRecipe'"),
        (["sampling.n=abc"], r"sampling\.n: Value 'abc' of type 'str' could not be converted to Integer"),
        (["sampling.n=0"], r"sampling: n \(0\) must be an integer >= 1"),
        (["sampling.seed=null"], r"sampling\.seed \(None\) must be an integer"),
        (["model.dtype=float8"], r"model\.dtype \('float8'\) must be one of"),
        (["distributed.balance=size"], r"distributed\.balance \('size'\) must be one of work, count"),
        (["distributed.share_history=maybe"], r"distributed\.share_history: Value 'maybe' is not a valid bool"),
        (
            ["sampling.temperature=-1"],
            r"sampling: temperature \(-1\.0\) must be 0 \(greedy decoding\) or a finite number >= 1e-05",
        ),
        (["spec.method=eagle"], r"spec: method \('eagle'\) must be one of"),
        (["spec.num_speculative_tokens_per_batch_size=[[1,8,3],[10,64,1]]"], r"spec: .* leave a gap at 9"),
        (["spec.num_speculative_tokens_per_batch_size=[[1,32,3]]"], r"spec: .* max_batch_size is 64"),
        (["spec.num_speculative_tokens_per_batch_size=[[1,64,5]]"], r"spec: .* K=5 outside"),
        (["spec.suffix_decoding_min_token_prob=2"], r"spec: suffix_decoding_min_token_prob \(2\.0\) must be"),
        (["spec.suffix_decoding_max_tree_depth=x"], r"spec\.suffix_decoding_max_tree_depth: Value 'x'"),
        (["rollout.n"], r"override 'rollout.n' must be key=value"),
        (["data.system_prompt=Be brief."], r"data\.system_prompt is a chat template's system message"),
        (["sampling.spec.method=ngram"], r"sampling\.spec .* is not set from a recipe: set the spec section"),
        # a list the shell split at its spaces, an unclosed quote: the value is not YAML (no traceback)
        (["spec.method=[suffix,", "draft_model]"], r"override 'spec.method=\[suffix,': its value is not valid YAML"),
        (['data.template="{prompt}'], r"not valid YAML .*quote the whole override"),
        # a value of another shape than the key's: what the key takes instead
        (["rewards=arithmetic"], r"rewards: takes a list, e\.g\. 'rewards=\[\{name: \.\.\.\}\]'"),
        (["rewards={name: arithmetic}"], r"rewards: takes a list"),
        (["sampling.stop_token_ids=5"], r"sampling\.stop_token_ids: takes a list"),
        (["model=tiny-target"], r"model: is a section: set its fields, e\.g\. model\.name="),
        (["bench.static_k.5=4"], r"give the whole list, e\.g\. bench\.static_k=\[1, 3, 5, \.\.\.\]"),
        (["data.template=Q: {prompt}"], r"a text that starts with a brace or holds ': ' needs quotes"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(RECIPES / "quickstart.yaml", overrides)


def test_text_fields_take_the_text_as_written(tmp_path):
    """YAML reads 007 as 7, 0123 as 83 (octal) and yes as True, and the structured config then held them as '7', '83'
    and 'True': output_dir=007 wrote to ./7. A text field takes the text as written, in a file and on the command line;
    null stays None, and the numbers and switches of other fields are read as before."""
    recipe_file = tmp_path / "texts.yaml"
    recipe_file.write_text(
        "output_dir: 0123\nlogging:\n  run_name: yes\n  project: 1e3\nsampling:\n  n: 2\n"
        "rewards:\n  - name: arithmetic\n    weight: 1\n"
    )
    recipe = load_recipe(recipe_file)
    assert (recipe.output_dir, recipe.logging.run_name, recipe.logging.project) == ("0123", "yes", "1e3")
    assert recipe.sampling.n == 2 and recipe.rewards[0].weight == 1.0
    recipe = load_recipe(recipe_file, ["output_dir=007", "data.template=5", "logging.run_name=null", "sampling.n=3"])
    assert (recipe.output_dir, recipe.data.template, recipe.logging.run_name, recipe.sampling.n) == (
        "007",
        "5",
        None,
        3,
    )
    assert load_recipe(recipe_file, ["rewards.0.name=arithmetic", "logging.plot=no"]).logging.plot is False
    # interpolations stay unresolved until the whole recipe is merged (read early, one to another section failed)
    (tmp_path / "interpolated.yaml").write_text("output_dir: ${logging.project}\nlogging:\n  run_name: ${sampling.n}\n")
    recipe = load_recipe(tmp_path / "interpolated.yaml")
    assert (recipe.output_dir, recipe.logging.run_name) == ("rollout", "1")


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="recipe file not found: .*missing.yaml"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: [unclosed\n")
    with pytest.raises(ValueError, match=r"bad.yaml:3:1: invalid YAML"):
        load_recipe(bad)
    for text, message in (
        ("rewards:\n  name: arithmetic\n", r"shape.yaml: rewards: takes a list"),
        ("model: tiny-target\n", r"shape.yaml: model: is a section: set its fields"),
    ):
        (tmp_path / "shape.yaml").write_text(text)
        with pytest.raises(ValueError, match=message):
            load_recipe(tmp_path / "shape.yaml")
    (tmp_path / "missing.yaml").write_text("sampling:\n  n: ???\nrewards: arithmetic\n")  # values that do not resolve
    with pytest.raises(ValueError, match=r"missing.yaml: rewards: takes a list"):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match=r"override 'sampling.n=\$\{sampling.top_k': sampling\.n: no viable alt"):
        load_recipe(RECIPES / "quickstart.yaml", ["sampling.n=${sampling.top_k"])
    (tmp_path / "one.yaml").write_text("5\n")  # valid YAML: it was called invalid ("Invalid loaded object type")
    with pytest.raises(ValueError, match=r"one.yaml: a recipe is a mapping of sections .*, got one value"):
        load_recipe(tmp_path / "one.yaml")
    nested = tmp_path / "nested.yaml"
    nested.write_text("rollout:\n  tail_fraction: high\n")
    with pytest.raises(ValueError, match=r"nested.yaml: rollout\.tail_fraction: Value 'high'"):
        load_recipe(nested)
