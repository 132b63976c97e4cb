"""Videos (encoder/video.py, VisionEncoder.encode_videos): the towers against transformers' own on checkpoints
written by `save_pretrained`, sampling and sizes against the processors' rules (transformers' Qwen3-VL video
processor module imports without torchvision, so its `sample_frames`, `smart_resize` and `patchify` are called
directly; Qwen2-VL's module needs torchvision, so its rules are checked by cases), and bad videos. The full
processor comparison (needs torchvision) is tests/test_video_processor.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import FAMILIES
from helpers import rel_err
from videos import make_video

from vitserve.encoder import EncodedVideo, VisionEncoder, video_nvdec
from vitserve.encoder import video as V
from vitserve.encoder.config import builtin_config

pytest.importorskip("av")
TOL = 1e-5


def reference(tower, pixel_values, grids):
    with torch.no_grad():
        out = tower(pixel_values, torch.tensor(grids))
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


@pytest.mark.parametrize("family", FAMILIES)
def test_videos_match_transformers_tower(checkpoints, family):
    """Two videos (an odd frame count: the last slice repeats its last frame) through encode_videos against
    transformers' tower on our pixel_values_videos and video_grid_thw: tokens and deepstack within 1e-5, and the
    slices split over several replays of small budgets (a video is never one indivisible item)."""
    path, hf_tower = checkpoints[family]
    enc = VisionEncoder.from_pretrained(path, budgets=(256,))
    clips = [
        make_video(30, 10, 160, 120),
        make_video(13, 6, 96, 128, codec="mpeg4", container="avi", photo="portrait.png"),
    ]
    pixels, grids = enc.preprocess_videos(clips, num_frames=8 if family != "qwen3_vl" else 7)
    ref, ref_deepstack = reference(hf_tower, pixels, grids.tolist())
    results = enc.encode_videos(clips, num_frames=8 if family != "qwen3_vl" else 7)
    assert all(isinstance(r, EncodedVideo) for r in results)
    assert [r.grid_thw for r in results] == [tuple(g) for g in grids.tolist()]
    assert all(r.grid_thw[0] == 4 for r in results)  # 7 frames -> 4 slices (the last padded)
    ours = torch.cat([r.embeddings for r in results])
    assert ours.shape == ref.shape and rel_err(ours, ref) <= TOL
    if family == "qwen3_vl":
        for j, ref_j in enumerate(ref_deepstack):
            assert rel_err(torch.cat([r.deepstack[j] for r in results]), ref_j) <= TOL
    else:
        assert all(r.deepstack == [] for r in results)
    assert enc.runner.stats.eager_runs + sum(b.replays for b in enc.runner.stats.budgets.values()) > 2


def tiny(family: str) -> str:
    return f"tiny-{family.replace('_', '-').replace('2-5', '2.5')}"


@pytest.fixture
def one_thread():
    """torch on one CPU thread for the test: with many threads the CPU's BLAS splits a GEMM's reduction by the
    matrix's size, so batches of other sizes round differently (docs/video.md); one thread fixes the order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_video_and_its_slices_alone_give_the_same_answer(family, one_thread):
    """A video encoded alone, beside another video, and one slice at a time give identical tokens: a slice's
    features depend on its own frames only."""
    enc = VisionEncoder.from_pretrained(tiny(family), load_format="dummy")
    clip, other = make_video(20, 10, 128, 96), make_video(9, 5, 64, 64, photo="portrait.png")
    alone = enc.encode_videos(clip, fps=4)
    together = enc.encode_videos([other, clip], fps=4)[1]
    assert torch.equal(alone.embeddings, together.embeddings)
    decoded = V.load_video(clip, enc.video_config.with_request(fps=4))
    lut = V.fast_lut(enc.video_config.image_mean, enc.video_config.image_std)
    per_slice = [enc.runner.collect(enc.runner.launch_images([s], lut))[0][0] for s in decoded.slices()]
    assert torch.equal(torch.cat(per_slice), alone.embeddings)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_on_cuda_graphs_a_video_alone_and_beside_another_are_equal(family):
    """The server's path (CUDA graphs, bfloat16): a video's tokens and deepstack do not depend on what shares its
    batch, bit for bit."""
    enc = VisionEncoder.from_pretrained(tiny(family), load_format="dummy", device="cuda", dtype="bfloat16")
    assert enc.runner.stats.mode == "graphs"
    clip, other = make_video(20, 10, 128, 96), make_video(9, 5, 64, 64, photo="portrait.png")
    alone = enc.encode_videos(clip, fps=4)
    together = enc.encode_videos([other, clip], fps=4)[1]
    assert torch.equal(alone.embeddings, together.embeddings)
    assert all(torch.equal(a, b) for a, b in zip(alone.deepstack, together.deepstack))


def test_qwen3_sampling_and_sizes_follow_transformers():
    """Qwen3-VL: frame indices and frame sizes against transformers' own sample_frames and smart_resize over a
    sweep of frame counts, rates and requests."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    cfg = V.VideoConfig.for_model(builtin_config("Qwen/Qwen3-VL-8B-Instruct"))
    proc = Qwen3VLVideoProcessor()
    for total, rate in ((1, 30.0), (3, 1.0), (7, 24.0), (60, 30.0), (301, 29.97), (5000, 60.0), (90, 0.0)):
        for request in ({}, {"fps": 1.0}, {"fps": 4.5}, {"num_frames": 5}, {"num_frames": 2}):
            info = V.VideoInfo(total, rate, 640, 360, "h264")
            md = VideoMetadata(total_num_frames=total, fps=rate or None)
            kw = {"num_frames": request.get("num_frames"), "fps": request.get("fps")} if request else {}
            expected = proc.sample_frames(md, **kw)
            got = V.sample_indices(info, cfg.with_request(**request))
            assert got.tolist() == np.asarray(expected).tolist(), (total, rate, request)
    for frames in (2, 3, 8, 64, 768):
        for h, w in ((360, 640), (1080, 1920), (20, 500), (4000, 30), (31, 31)):
            for cap in (False, True):
                c = dataclasses.replace(cfg, cap_pixels_per_frame=cap)
                max_pixels = c.max_pixels
                if cap:
                    f = c.factor
                    max_pixels = (
                        max(min(c.max_video_tokens * f * f, c.max_pixels // frames), int(c.min_pixels * 1.05)) * frames
                    )
                expected = smart_resize(frames, h, w, 2, 32, c.min_pixels, max_pixels)
                assert V.frame_size(frames, h, w, c) == expected, (frames, h, w, cap)


def test_qwen2_sampling_follows_its_rules():
    """Qwen2/2.5-VL (transformers' Qwen2VLVideoProcessor.sample_frames, whose module needs torchvision): no
    sampling unless asked; `fps` frames a second floored to a whole temporal patch, at least min_frames and at most
    the video; `num_frames` rounded to a temporal patch; `arange` steps truncated."""
    cfg = V.VideoConfig.for_model(builtin_config("Qwen/Qwen2.5-VL-7B-Instruct"))
    info = V.VideoInfo(30, 10.0, 320, 240, "h264")
    assert V.sample_indices(info, cfg).tolist() == list(range(30))  # do_sample_frames is off by default
    assert V.sample_indices(info, cfg.with_request(fps=2)).tolist() == [0, 5, 10, 15, 20, 25]  # 3 s x 2 = 6
    assert V.sample_indices(info, cfg.with_request(fps=1)).tolist() == [0, 7, 15, 22]  # 3 -> min_frames 4
    assert V.sample_indices(info, cfg.with_request(num_frames=5)).tolist() == [0, 7, 15, 22]  # round(5/2)*2 = 4
    assert V.sample_indices(V.VideoInfo(7, 10.0, 64, 64, "h264"), cfg.with_request(fps=30)).tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]  # at most the video, floored to a temporal patch
    with pytest.raises(V.VideoTooShort):
        V.sample_indices(V.VideoInfo(1, 10.0, 64, 64, "h264"), cfg.with_request(fps=2))
    assert V.frame_size(6, 480, 640, cfg) == (476, 644)  # the image smart_resize per frame (factor 28)
    assert V.frame_size(6, 240, 320, cfg) == (280, 392)  # under min_pixels (128 x 28²): scaled up


def qwen2_sample_frames():
    """transformers' Qwen2VLVideoProcessor.sample_frames, the function itself read from its module's source (the
    module imports torchvision, which does not load here)."""
    import ast
    import math
    import types
    from pathlib import Path

    import transformers

    path = Path(transformers.__file__).parent / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    names = {"math": math, "torch": torch, "VideoMetadata": object}
    exec(compile(ast.Module([fn], []), str(path), "exec"), names)
    self = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4, max_frames=768)
    return lambda total, rate, **kw: names["sample_frames"](
        self, types.SimpleNamespace(total_num_frames=total, fps=rate), **kw
    ).tolist()


@pytest.mark.parametrize("family", ["Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"])
def test_max_frames_caps_what_is_sampled(family):
    """A request's max_frames (and so --max-video-frames, which the server passes as one) caps the frames sampled
    whatever the rule: Qwen2's default (every frame: a one-minute 30 fps clip was 1800 frames), its fps and
    num_frames, Qwen3's num_frames. The cap spreads its frames evenly: transformers' Qwen2 sample_frames given
    num_frames=cap; under the cap every rule samples as transformers' does."""
    sample_frames = qwen2_sample_frames()
    cfg = V.VideoConfig.for_model(builtin_config(family))
    minute = V.VideoInfo(1800, 30.0, 1280, 720, "h264")
    if family.startswith("Qwen/Qwen2"):
        assert V.sample_indices(minute, cfg).tolist() == sample_frames(1800, 30.0, num_frames=768)  # the default cap
        assert V.sample_indices(V.VideoInfo(30, 10.0, 64, 64, "h264"), cfg).tolist() == list(range(30))  # uncapped
        for request in ({"fps": 2}, {"num_frames": 100}):  # under the cap: transformers' own rule
            assert V.sample_indices(minute, cfg.with_request(**request)).tolist() == sample_frames(
                1800, 30.0, **request
            )
    for request in ({}, {"fps": 2}, {"fps": 30}, {"num_frames": 100}):
        for cap in (16, 100, 7):
            got = V.sample_indices(minute, cfg.with_request(max_frames=cap, **request)).tolist()
            assert len(got) <= cap, (request, cap)
            if cfg.family == "qwen2" and request.get("fps") != 2:  # 2 fps: 120 frames, min(120, cap) by its rule
                assert got == sample_frames(1800, 30.0, num_frames=cap // 2 * 2), (request, cap)
    with pytest.raises(V.VideoTooShort, match="max_frames 1 is less than one temporal patch"):
        V.sample_indices(minute, dataclasses.replace(cfg, max_frames=1, do_sample_frames=False))


def test_layout_is_transformers_patchify():
    """Our rows of one video are transformers' Qwen3VLVideoProcessor.patchify of the same normalized frames, an odd
    frame count included (its last frame repeated)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen3-vl"))
    video = V.load_video(make_video(9, 9, 128, 96), cfg.with_request(num_frames=5))
    assert len(video.frames) == 5
    ours, grid = V.patchify(video, cfg)
    lut = V.fast_lut(cfg.image_mean, cfg.image_std)
    normalized = torch.from_numpy(lut[np.arange(3), video.frames]).permute(0, 3, 1, 2)[None]  # [1, F, C, H, W]
    theirs, t, h, w = Qwen3VLVideoProcessor().patchify(
        normalized, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    )
    assert (t, h, w) == grid and t == 3
    assert torch.equal(theirs[0], torch.from_numpy(ours))


def test_timing_for_the_llm():
    """Qwen3-VL's per-slice timestamps (the mean of a slice's first and last frame times, transformers'
    Qwen3VLProcessor._calculate_timestamps) and Qwen2.5-VL's second_per_grid_t (T / the sampled rate)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen3-vl"))
    video = V.load_video(make_video(25, 5, 64, 64), cfg)  # 5 s at 5 fps, sampled at 2 fps
    expected = Qwen3VLProcessor._calculate_timestamps(None, video.indices.tolist(), 5.0, 2)
    assert video.timestamps == pytest.approx(expected) and len(video.timestamps) == len(video.slices())
    assert video.second_per_grid_t == pytest.approx(2 / (len(video.indices) / 25 * 5))


def test_containers_without_a_frame_count_are_counted():
    """WebM records no frame count (PyAV says 0; transformers' pyav reader fails there): the packets are counted."""
    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen2.5-vl")).with_request(num_frames=4)
    video = V.load_video(make_video(12, 6, 64, 48, codec="libvpx-vp9", container="webm"), cfg)
    assert video.info.total_frames == 12 and video.indices.tolist() == [0, 3, 6, 9]


@pytest.mark.parametrize("data, error", [(b"not a video at all", V.VideoError), (b"", V.VideoError)])
def test_bad_videos_raise_video_errors(data, error):
    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen2.5-vl"))
    with pytest.raises(error):
        V.load_video(data, cfg)


def test_an_image_is_not_a_video():
    from corpus import encode, photo

    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen2.5-vl")).with_request(num_frames=2)
    with pytest.raises(V.VideoError):
        V.load_video(encode(photo(64, 64), "PNG"), cfg)


def test_a_truncated_video_fails_cleanly():
    """A file cut in half: what it declares cannot be decoded; the error is a VideoError, never a crash."""
    data = make_video(40, 10, 128, 96)
    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen2.5-vl")).with_request(num_frames=8)
    with pytest.raises(V.VideoError):
        V.load_video(data[: len(data) // 2], cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_videos_on_cuda_graphs_match_transformers_tower(checkpoints, family):
    """On a GPU, in float32 with graphs: slices cut on the device, beside an image in one launch (two normalization
    tables), match transformers' tower on the video and the image alone."""
    from PIL import Image

    path, hf_tower = checkpoints[family]
    enc = VisionEncoder.from_pretrained(path, device="cuda")
    clip = make_video(30, 10, 160, 120)
    pixels, grids = enc.preprocess_videos(clip, num_frames=6)
    ref, _ = reference(hf_tower, pixels, grids.tolist())
    video = V.load_video(clip, enc.video_config.with_request(num_frames=6))
    image = np.asarray(Image.open("examples/sample.jpg").convert("RGB").resize((224, 224)))  # sides: 14k and 16k
    outputs = enc.outputs(enc.launch([image, *video.slices()]))
    assert rel_err(torch.cat([tokens for tokens, _ in outputs[1:]]), ref) <= 1e-4
    alone = enc.outputs(enc.launch([image]))[0][0]
    assert rel_err(outputs[0][0], alone) <= 1e-5


def test_the_memory_a_video_takes_is_known_from_its_header():
    """video_cost's memory (what a server reserves before decoding) is what load_video keeps plus one decoded
    frame."""
    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen3-vl")).with_request(fps=4)
    clip = make_video(30, 10, 160, 120)
    video = V.load_video(clip, cfg)
    assert V.video_cost(clip, cfg).memory == video.frames.nbytes + 160 * 120 * 3
    with pytest.raises(V.VideoTooLarge):
        V.video_cost(clip, cfg, V.VideoLimits(max_bytes=video.frames.nbytes - 1))


@pytest.fixture
def nvdec_untried(monkeypatch):
    """This process as if NVDEC had not been tried yet (a refusal is remembered for the process)."""
    monkeypatch.setattr(V, "_nvdec_refused", None)
    monkeypatch.setattr(V, "_nvdec_tried", False)


@pytest.mark.skipif(video_nvdec.unavailable() is None, reason="the fallback: a machine where NVDEC cannot run")
def test_nvdec_falls_back_to_software_with_the_same_frames(nvdec_untried):
    """decoder "nvdec" where NVDEC cannot run (no PyNvVideoCodec or no GPU): the video decodes in software (the same
    frames, said so), NVDEC's refusal is remembered with its reason, and a file that no decoder opens is still the
    file's error (a VideoError), not taken as NVDEC's."""
    clip = make_video(30, 10, 160, 120)
    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen3-vl")).with_request(num_frames=6)
    nvdec = dataclasses.replace(cfg, decoder="nvdec")
    with pytest.raises(V.VideoError):
        V.load_video(b"\x00\x00\x00\x18ftypmp42" + bytes(64), nvdec)
    assert V.nvdec_refused() is None
    video = V.load_video(clip, nvdec)
    assert video.decoder == "cpu" and V.nvdec_refused()
    assert np.array_equal(video.frames, V.load_video(clip, cfg).frames)
    assert V.load_video(clip, nvdec).decoder == "cpu"  # not tried again


@pytest.mark.gpu
@pytest.mark.skipif(video_nvdec.unavailable() is not None, reason=f"needs NVDEC: {video_nvdec.unavailable()}")
@pytest.mark.parametrize("codec", ["h264", "hevc", "libvpx-vp9", "mjpeg"])
@pytest.mark.parametrize("planes", [False, True], ids=["rgb", "planes"])
def test_nvdec_decodes_the_frames_software_does(nvdec_untried, codec, planes):
    """On a GPU: NVDEC decodes H.264, HEVC and VP9 (said so by `decoder`) to the software decoder's frames, byte for
    byte, as RGB frames made in the process or as planes for the devices (the same planes), a whole video and a part
    of it; a codec it does not take (MJPEG) decodes in software, the same frames."""
    container = {"libvpx-vp9": "webm", "mjpeg": "avi"}.get(codec, "mp4")
    clip = make_video(40, 10, 320, 240, codec=codec, container=container)
    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen2.5-vl")).with_request(fps=4)
    nvdec = dataclasses.replace(cfg, decoder="nvdec")
    for part in (None, (1, 3)):
        video = V.load_video(clip, nvdec, planes=planes, part=part)
        assert video.decoder == ("cpu" if codec == "mjpeg" else "nvdec")
        software = V.load_video(clip, cfg, planes=planes, part=part)
        assert video.layout == software.layout and video.resized == software.resized
        assert np.array_equal(video.indices, software.indices) and np.array_equal(video.frames, software.frames)


def test_the_video_decoder_is_chosen():
    """video_config_of: software decoding unless NVDEC is asked for; a decoder that does not exist is refused."""
    cfg = builtin_config("tiny-qwen3-vl")
    from vitserve.encoder.vision_encoder import video_config_of

    assert video_config_of(cfg, None, "nvdec").decoder == "nvdec"
    assert video_config_of(cfg, None).decoder == "cpu"
    with pytest.raises(ValueError, match="decoder"):
        V.VideoConfig.for_model(cfg).__class__(family="qwen3", patch_size=16, decoder="gpu")


def test_a_hub_download_fetches_and_uses_the_video_processor_settings(checkpoints, tmp_path, monkeypatch):
    """A Qwen3-VL checkpoint from the hub (a fake hub: huggingface_hub's download serving a checkpoint written by
    save_pretrained, plus the published video_preprocessor_config.json): the download asks for the video
    processor's settings beside the image's, and the videos are sized by them (a one-minute 720p clip at 2 fps:
    transformers' grid [60, 20, 38], where preprocessor_config.json's pixels gave [60, 16, 30])."""
    import json
    import shutil
    from pathlib import Path

    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    from vitserve.encoder.vision_encoder import load_configs, video_config_of

    repo = tmp_path / "repo"
    shutil.copytree(checkpoints["qwen3_vl"][0], repo)
    (repo / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "size": {"shortest_edge": 65536, "longest_edge": 16777216},
                "patch_size": 16,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "image_mean": [0.5] * 3,
                "image_std": [0.5] * 3,
            }
        )
    )
    (repo / "video_preprocessor_config.json").write_text(json.dumps(V.PUBLISHED["qwen3_vl"]))
    asked = []

    def download(repo_id, filename, revision=None, cache_dir=None, local_files_only=False):
        asked.append(filename)
        if not (repo / filename).is_file():
            raise EntryNotFoundError(f"{filename} is not in {repo_id}")
        target = tmp_path / "cache" / filename
        target.parent.mkdir(exist_ok=True)
        shutil.copy(repo / filename, target)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    cfg, _, ckpt = load_configs("Qwen/Qwen3-VL-Fake", allow_download=True)
    assert "video_preprocessor_config.json" in asked and Path(ckpt) == tmp_path / "cache"
    vcfg = video_config_of(cfg, ckpt)
    minute = V.VideoInfo(1800, 30.0, 1280, 720, "h264")
    frames = len(V.sample_indices(minute, vcfg))
    assert (frames // 2, *(side // vcfg.patch_size for side in V.frame_size(frames, 720, 1280, vcfg))) == (60, 20, 38)


def test_dummy_weights_of_a_published_model_take_its_video_settings():
    """--load-format dummy on a built-in hub id preprocesses videos as the published checkpoint does (a one-minute
    720p clip: Qwen3-VL's [60, 20, 38], 11,400 tokens, not the class defaults' 180); a tiny-* model keeps the
    processor class's defaults."""
    from vitserve.encoder.vision_encoder import video_config_of

    minute = V.VideoInfo(1800, 30.0, 1280, 720, "h264")

    def grid(model):
        cfg = builtin_config(model)
        vcfg = video_config_of(cfg, None, model=model)
        frames = len(V.sample_indices(minute, vcfg))
        h, w = V.frame_size(frames, 720, 1280, vcfg)
        return frames // 2, h // vcfg.patch_size, w // vcfg.patch_size

    assert grid("Qwen/Qwen3-VL-8B-Instruct") == (60, 20, 38)
    assert grid("qwen3-vl-8b-instruct") == (60, 20, 38)
    assert (
        video_config_of(
            builtin_config("Qwen/Qwen2.5-VL-7B-Instruct"), None, model="Qwen/Qwen2.5-VL-7B-Instruct"
        ).max_pixels
        == 12845056
    )
    assert video_config_of(builtin_config("tiny-qwen3-vl"), None, model="tiny-qwen3-vl") == V.VideoConfig.for_model(
        builtin_config("tiny-qwen3-vl")
    )


def test_a_max_pixels_under_the_videos_minimum_is_refused_not_clamped():
    """VideoConfig.with_request: a max_pixels under min_pixels is a ValueError (the server's 400), as for images;
    at the minimum it applies."""
    cfg = V.VideoConfig.for_model(builtin_config("tiny-qwen2.5-vl"))
    with pytest.raises(ValueError, match=f"at least the videos' min_pixels \\({cfg.min_pixels}\\)"):
        cfg.with_request(max_pixels=cfg.min_pixels - 1)
    assert cfg.with_request(max_pixels=cfg.min_pixels).max_pixels == cfg.min_pixels
    with pytest.raises(ValueError, match="min_pixels"):
        dataclasses.replace(cfg, min_pixels=cfg.max_pixels + 1)


def test_sampling_errors_name_what_is_at_fault():
    """num_frames under a temporal patch names num_frames (not "the video has 48 frames"); counts read "1 frame";
    a num_frames over the video's frames is a VideoTooShort saying so, or with truncate_frames every frame (floored
    to a temporal patch for Qwen2, all of them for Qwen3, whose rule otherwise repeats frames)."""
    qwen2 = V.VideoConfig.for_model(builtin_config("tiny-qwen2.5-vl"))
    qwen3 = V.VideoConfig.for_model(builtin_config("tiny-qwen3-vl"))
    clip = V.VideoInfo(48, 24.0, 64, 64, "h264")
    for cfg in (qwen2, qwen3):
        with pytest.raises(V.VideoTooShort, match=r"^num_frames 1 is less than one temporal patch \(2 frames\)$"):
            V.sample_indices(clip, cfg.with_request(num_frames=1))
    with pytest.raises(V.VideoTooShort, match=r"^the video has 1 frame, fewer than one temporal patch"):
        V.sample_indices(V.VideoInfo(1, 10.0, 64, 64, "h264"), qwen2.with_request(fps=2))
    with pytest.raises(V.VideoTooShort, match=r"^num_frames 60 is more than the video's 48 frames \(truncate_frames"):
        V.sample_indices(clip, qwen2.with_request(num_frames=60))
    short = V.VideoInfo(7, 24.0, 64, 64, "h264")
    assert V.sample_indices(short, qwen2.with_request(num_frames=60, truncate_frames=True)).tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    assert V.sample_indices(short, qwen3.with_request(num_frames=60, truncate_frames=True)).tolist() == list(range(7))
    assert len(V.sample_indices(short, qwen3.with_request(num_frames=60))) == 60  # transformers' rule, repeating
