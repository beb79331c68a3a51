"""fvx_methods.library.distill_schedule: the three forms of streaming long tuning's schedule, their defaults, every
refusal (the message names the field) and the active stage at the boundaries (spec §2.8, "Schedule parsing")."""
import pytest

from fvx_methods.library import distill_schedule as ds
from fvx_methods.library.distill_schedule import Stage

WHERE = "method.multi_phased_distill_schedule"
WORLDMODEL = [{"stage": "streaming_long", "start_step": 0, "end_step": 3000, "num_latent_t": 39,
               "streaming_training": True, "streaming_chunk_size": 9, "streaming_max_length": 39,
               "streaming_fixed_overlap_latents": 3}]
TWO_STAGES = [{"stage": "self_forcing", "end_step": 700, "num_latent_t": 21}, {"stage": "long", "num_latent_t": 240}]


def parse(raw, **overrides):
    """The schedule of a run whose data has 21 latent frames and whose method streams in chunks of 3."""
    return ds.parse(raw, **{"default_num_latent_t": 21, "default_chunk_size": 3, **overrides})


def refused(raw, *fragments, **overrides):
    """Parsing ``raw`` raises a ValueError whose message holds every fragment."""
    with pytest.raises(ValueError) as error:
        parse(raw, **overrides)
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


# The empty form.

@pytest.mark.parametrize("raw", [None, "", [], (), " , ,"])
def test_empty_is_one_open_streaming_stage_over_the_data(raw):
    assert parse(raw) == (Stage("streaming_long", 0, None, 21, True, chunk_size=3, max_length=21),)


def test_empty_uses_the_default_max_length_when_set():
    assert parse(None, default_max_length=240) == (
        Stage("streaming_long", 0, None, 240, True, chunk_size=3, max_length=240),)
    assert parse([], default_max_length=None, default_chunk_size=9) == (
        Stage("streaming_long", 0, None, 21, True, chunk_size=9, max_length=21),)


# The string form.

def test_string_two_fields_start_where_the_previous_entry_ended():
    assert parse(" 700:21 , 1500 : 60,, 3000:120 ") == (
        Stage("self_forcing", 0, 700, 21, False),
        Stage("streaming_long", 700, 1500, 60, True, chunk_size=3, max_length=60),
        Stage("streaming_long", 1500, 3000, 120, True, chunk_size=3, max_length=120))


def test_string_three_fields_give_the_start():
    assert parse("100:700:21, 800:1500:60,2000:90") == (
        Stage("self_forcing", 100, 700, 21, False),
        Stage("streaming_long", 800, 1500, 60, True, chunk_size=3, max_length=60),
        Stage("streaming_long", 1500, 2000, 90, True, chunk_size=3, max_length=90))


def test_a_lone_self_forcing_stage_needs_no_chunk_size():
    assert parse("700:21", default_chunk_size=None) == (Stage("self_forcing", 0, 700, 21, False),)


@pytest.mark.parametrize("entry", ["700", "1:2:3:4", "700:x", "700:21.5", "700:"])
def test_string_entries_of_another_shape_are_refused(entry):
    refused(f"100:21,{entry}", WHERE, repr(entry), "'end:num_latent_t' or 'start:end:num_latent_t'")


def test_messages_name_the_callers_where():
    with pytest.raises(ValueError, match="cfg.schedule: entry 'x'"):
        ds.parse("x", default_num_latent_t=21, where="cfg.schedule")


# The list form.

def test_worldmodel_recipe():
    assert parse(WORLDMODEL) == (Stage("streaming_long", 0, 3000, 39, True, chunk_size=9, max_length=39,
                                       fixed_overlap=3),)


def test_two_stages_start_from_the_previous_end_and_stream_by_name():
    assert parse(TWO_STAGES) == (Stage("self_forcing", 0, 700, 21, False), Stage("long", 700, None, 240, True))


def test_list_defaults_and_fallbacks():
    stages = parse([{"name": "streaming", "end_step": 10, "streaming_max_length": 60, "max_length": 90},
                    {"end_step": "20", "max_length": 90},
                    {"stage": "", "start_step": 25, "streaming_training": "True", "streaming_min_new_frame": 2}])
    assert stages == (Stage("streaming", 0, 10, 60, True, max_length=60),
                      Stage("self_forcing", 10, 20, 90, False),
                      Stage("streaming_long", 25, None, 21, True, min_new_frame=2))


def test_streaming_training_overrides_the_name():
    assert parse([{"stage": "long", "streaming_training": False, "num_latent_t": " 21 "}]) == (
        Stage("long", 0, None, 21, False),)
    assert parse([{"stage": "warmup", "streaming_training": "true", "end_step": 5}]) == (
        Stage("warmup", 0, 5, 21, True),)


def test_stage_wins_over_name():
    assert parse([{"stage": "long", "name": "self_forcing"}])[0].name == "long"


def test_a_stage_without_end_leaves_the_previous_end():
    stages = ds.from_list([{"end_step": 5}, {"stage": "long"}, {"stage": "long"}], default_num_latent_t=21,
                          where=WHERE)
    assert [stage.start_step for stage in stages] == [0, 5, 5]


def test_unknown_keys_are_refused_with_the_nearest_and_the_known_ones():
    refused([{"stage": "long"}, {"stage": "long", "end_stpe": 5}],
            f"{WHERE}[1]", "'end_stpe'", "did you mean 'end_step'", "streaming_fixed_overlap_latents")


@pytest.mark.parametrize("key, value", [("end_step", True), ("num_latent_t", 21.0), ("start_step", "ten"),
                                        ("streaming_chunk_size", [3]), ("streaming_training", "yes"),
                                        ("streaming_training", 1), ("stage", 3)])
def test_values_of_the_wrong_type_are_refused(key, value):
    refused([{"end_step": 700}, {key: value}], f"{WHERE}[1].{key}", repr(value))


@pytest.mark.parametrize("raw", [42, 1.5, {"stage": "long"}])
def test_other_types_are_refused(raw):
    refused(raw, f"{WHERE} must be a list of stages, a string 'end:num_latent_t,...' or empty", repr(raw))


def test_list_items_must_be_dicts():
    refused([700], f"{WHERE}[0] must be a dict", "700")


# The checks.

@pytest.mark.parametrize("raw, fragments", [
    ([{"start_step": -1, "end_step": 5}], ("[0].start_step must be >= 0, got -1",)),
    ([{"start_step": 5, "end_step": 5}], ("[0].end_step = 5 must be > start_step = 5",)),
    ("700:21,1500:0", ("[1].num_latent_t must be > 0, got 0",)),
    ("0:700:21,600:1500:60", ("[1].start_step = 600 overlaps the previous stage 'self_forcing'", "ends at 700")),
    ([{"stage": "long"}, {"stage": "long", "start_step": 100}], ("[1].start_step", "open-ended stage 'long'")),
    ([{"stage": "long", "num_latent_t": 21, "streaming_max_length": -5}],
     ("[0].streaming_max_length must be > 0, got -5",)),
    ([{"stage": "long", "streaming_chunk_size": -3}], ("[0].streaming_chunk_size must be > 0", "got -3")),
    ([{"stage": "long", "streaming_chunk_size": 9, "streaming_fixed_overlap_latents": 9}],
     ("[0].streaming_fixed_overlap_latents = 9 must be in [0, 9)",)),
    ([{"stage": "long", "streaming_fixed_overlap_latents": -1}],
     ("[0].streaming_fixed_overlap_latents = -1 must be in [0, 3)",)),
    ([{"stage": "long", "streaming_min_new_frame": 0}], ("[0].streaming_min_new_frame must be >= 1, got 0",)),
])
def test_invalid_schedules_are_refused_naming_the_field(raw, fragments):
    refused(raw, *(WHERE + fragment for fragment in fragments[:1]), *fragments[1:])


def test_a_streaming_stage_needs_a_chunk_size():
    refused(None, f"{WHERE}[0].streaming_chunk_size must be > 0", "the method's: None", default_chunk_size=None)
    refused("700:21,1500:60", f"{WHERE}[1].streaming_chunk_size", default_chunk_size=None)
    assert parse([{"stage": "long", "streaming_chunk_size": 4, "streaming_fixed_overlap_latents": 0}],
                 default_chunk_size=None) == (Stage("long", 0, None, 21, True, chunk_size=4, fixed_overlap=0),)


# select and the helpers.

def test_select_at_the_boundaries():
    stages = parse("700:21,1500:60,3000:120")
    expected = {0: 0, 1: 0, 699: 0, 700: 1, 1499: 1, 1500: 2, 2999: 2, 3000: 2, 10**6: 2}
    assert {iteration: ds.select(stages, iteration) for iteration in expected} == expected


def test_select_outside_every_stage_takes_the_last():
    stages = parse("100:700:21,800:1500:60,1600:3000:120")
    assert [ds.select(stages, iteration) for iteration in (50, 99, 100, 750, 1550, 1600)] == [2, 2, 0, 2, 2, 2]


def test_select_an_open_ended_stage():
    stages = parse(TWO_STAGES)
    assert [ds.select(stages, iteration) for iteration in (0, 699, 700, 10**9)] == [0, 0, 1, 1]


def test_select_needs_a_stage():
    with pytest.raises(ValueError, match="at least one stage"):
        ds.select((), 1)


def test_max_length_and_chunk_size():
    short, long = parse(TWO_STAGES)[1], parse(WORLDMODEL)[0]
    assert (ds.max_length(short), ds.max_length(long)) == (240, 39)
    assert (ds.chunk_size(short, 3), ds.chunk_size(long, 3)) == (3, 9)
