"""Training memory planner dashboard: `streamlit run app.py`.

Holds the page config, the sidebar inputs every page shares (defined once, here, each
keyed by its views.inputs.SidebarValues field name) and the st.navigation router
over app_pages/ (not pages/: Streamlit's automatic pages/ folder and st.navigation
together break shared sidebars). Pages read the sidebar with SidebarValues.from_state.
"""

import streamlit as st

from app_pages.model_cache import cached_hub_config
from app_pages.query_state import decode_with_rejects, encode, rejects_warning
from planner.catalog import catalog_entries
from planner.errors import PlannerInputError
from planner.finetune import Method
from planner.scenario import Attention, Device, Precision, Task
from views.escaping import markdown_text
from views.inputs import (
    CUSTOM_GPU,
    DEFAULTS,
    FINETUNE_LABELS,
    GPU_PRESETS,
    MAXIMA,
    MODEL_SOURCE_LABELS,
    OPTIMIZER_LABELS,
    PRECISION_LABELS,
    QUANT_TYPE_LABELS,
    STRATEGY_LABELS,
    ModelSource,
    config_task_value,
    default_task,
    preset_caption,
    remember_upload,
    uploaded_task,
)

# An emoji favicon is drawn in the browser (an inline SVG); a ":material/...:" one is fetched
# from fonts.gstatic.com on every page load, which fails offline.
st.set_page_config(page_title="Training memory planner", page_icon="🧮", layout="wide")

# Initial values through session state rather than each widget's value=, so a widget
# that a callback changes (task) or that is hidden for a while keeps one source of defaults.
# A shared link's query string wins over the defaults, once, when the session starts.
if "_restored_from_link" not in st.session_state:
    st.session_state["_restored_from_link"] = True
    restored, st.session_state["_link_rejects"] = decode_with_rejects(st.query_params.to_dict())
    for key, value in restored.items():
        st.session_state[key] = value
for key, value in DEFAULTS.items():
    st.session_state.setdefault(key, value)
    # Own every sidebar value in every run. Streamlit deletes a widget's value after a run that
    # does not draw it (Labels under a causal LM, LoRA's fields under Full fine-tuning), which
    # lost the user's value; and a widget drawn again from a value not assigned in that run is
    # shown in the browser at its own default (a number input's minimum) while the server plans
    # the stored one, until the browser sends its 1 back. An assigned value survives the hidden
    # runs and is sent with the widget (Streamlit docs, "Widget behavior": interrupting the
    # widget clean-up process).
    st.session_state[key] = st.session_state[key]


def _follow_default_task() -> None:
    # A newly picked catalog model starts from the task it is usually fine-tuned for.
    st.session_state["task"] = default_task(st.session_state["catalog_model"])


def _follow_uploaded_task() -> None:
    # A newly uploaded config is planned as the model its `architectures` names, and kept by
    # its hash so the link restores it (runners.config_store).
    upload = st.session_state.get("config_upload")
    try:
        st.session_state["config_hash"] = remember_upload(upload)
        st.session_state.pop("_upload_not_stored", None)
    except PlannerInputError as error:
        st.session_state["config_hash"] = ""
        st.session_state["_upload_not_stored"] = str(error)
    task = uploaded_task(upload)
    if task is not None:
        st.session_state["task"] = task


def _follow_hub_task() -> None:
    # A newly entered hub id is planned as the model its `architectures` names; a fetch that
    # fails is the page's to report (the same cached fetch, st.error there).
    model_id = st.session_state.get("hub_model_id", "").strip()
    if not model_id:
        return
    try:
        task = config_task_value(cached_hub_config(model_id))
    except PlannerInputError:
        return
    if task is not None:
        st.session_state["task"] = task


with st.sidebar:
    st.header("Scenario")
    source = st.radio("Model from", list(MODEL_SOURCE_LABELS), format_func=MODEL_SOURCE_LABELS.get,
                      key="model_source", horizontal=True)
    if source == ModelSource.CATALOG.value:
        entries = catalog_entries()
        st.selectbox("Catalog model", list(entries), key="catalog_model", on_change=_follow_default_task,
                     help="Type to search. " + entries[st.session_state["catalog_model"]].description)
    elif source == ModelSource.HUB.value:
        st.text_input("Hub model id", key="hub_model_id", on_change=_follow_hub_task, placeholder="owner/name",
                      help="Fetches only the model's config.json from the Hugging Face hub (online only; "
                           "$PLANNER_HUB_URL or $HF_ENDPOINT names a mirror), once per id.")
    else:
        st.file_uploader("Model config.json", type=["json"], key="config_upload", on_change=_follow_uploaded_task,
                         help="A transformers config.json: only its shape is read, never any weights. It is kept "
                              "on this machine by its hash, so the page's link restores it here.")
        if st.session_state.get("_upload_not_stored"):
            st.caption(markdown_text(st.session_state["_upload_not_stored"]))  # it names a directory
    task = st.selectbox("Task", [t.value for t in Task], key="task")
    if Task(task).uses_labels:
        st.number_input("Labels", min_value=1, max_value=MAXIMA["num_labels"], step=1, key="num_labels")

    st.subheader("Training step")
    st.number_input("Batch size (sequences per micro-batch)", min_value=1, max_value=MAXIMA["batch_size"], step=1,
                    key="batch_size")
    st.number_input("Sequence length (tokens)", min_value=1, max_value=MAXIMA["seq_len"], step=64, key="seq_len")
    if task == Task.SEQ2SEQ_LM.value:
        st.number_input("Target length (tokens)", min_value=1, max_value=MAXIMA["target_len"], step=16,
                        key="target_len", help="Tokens per target sequence (the labels the decoder trains on).")
    st.number_input("Gradient accumulation steps", min_value=1, max_value=MAXIMA["grad_accum"], step=1,
                    key="grad_accum")
    st.selectbox("Optimizer", list(OPTIMIZER_LABELS), format_func=OPTIMIZER_LABELS.get, key="optimizer")
    st.selectbox("Precision", [p.value for p in Precision], format_func=PRECISION_LABELS.get, key="precision")
    st.toggle("Gradient checkpointing", key="gradient_checkpointing")
    st.selectbox("Attention", [a.value for a in Attention], key="attn")

    st.subheader("Fine-tuning")
    method = st.radio("Fine-tuning", list(FINETUNE_LABELS), format_func=FINETUNE_LABELS.get, key="finetune",
                      horizontal=True, label_visibility="collapsed",
                      help="Full: every parameter trains. LoRA: PEFT adapters on a frozen base. QLoRA: the same "
                           "on a 4-bit base (bitsandbytes).")
    if method != Method.FULL.value:
        # The planner checks every value (planner.finetune): a bad one is its one-line error on the page.
        rank_column, alpha_column = st.columns(2)
        rank_column.number_input("Rank r", min_value=0, max_value=MAXIMA["lora_r"], step=1, key="lora_r",
                                 help="LoraConfig(r=...)")
        alpha_column.number_input("Alpha", min_value=0.0, step=1.0, key="lora_alpha", placeholder="2 × r",
                                  help="LoraConfig(lora_alpha=...); empty: 2 × r")
        st.number_input("Dropout", min_value=0.0, max_value=1.0, step=0.05, format="%.2f", key="lora_dropout",
                        help="LoraConfig(lora_dropout=...), a probability below 1")
        st.text_input("Target modules", key="lora_targets",
                      help="all-linear (every linear layer but the output layer), or module names, "
                           "comma-separated: q_proj,v_proj")
    if method == Method.QLORA.value:
        st.selectbox("4-bit type", list(QUANT_TYPE_LABELS), format_func=QUANT_TYPE_LABELS.get, key="quant_type",
                     help="BitsAndBytesConfig(bnb_4bit_quant_type=...)")
        st.toggle("Double quantisation", key="double_quant",
                  help="BitsAndBytesConfig(bnb_4bit_use_double_quant=...): the quantisation constants quantised too")

    st.subheader("Hardware")
    device_kind = st.radio("Device kind", [d.value for d in Device], key="device", horizontal=True,
                           help="Activation memory differs by device (CPU dropout masks are fp32, CUDA's one byte).")
    if device_kind == Device.CUDA.value:
        st.toggle("Expandable segments", key="expandable_segments",
                  help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching allocator grows one "
                       "segment per pool instead of cudaMalloc-ing new ones, which changes the reserved memory "
                       "the verdict replays (not the tensors).")
    preset = st.selectbox("GPU", list(GPU_PRESETS), key="gpu_preset")
    if preset == CUSTOM_GPU:
        st.number_input("GPU capacity (GiB)", min_value=0.01, max_value=MAXIMA["gpu_custom_gib"], step=1.0,
                        format="%.2f", key="gpu_custom_gib")
    else:
        st.caption(preset_caption(preset))
    gpu_count = st.number_input("Number of GPUs", min_value=1, max_value=MAXIMA["gpu_count"], step=1, key="gpu_count",
                                help="Every page plans per GPU; the Multiple GPUs page compares the strategies.")
    if gpu_count > 1:
        st.selectbox("Strategy", list(STRATEGY_LABELS), format_func=STRATEGY_LABELS.get, key="strategy",
                     help="What each GPU holds: a full replica (DDP) or a 1/N shard of the optimizer state, "
                          "gradients and parameters (ZeRO, FSDP).")

    if st.session_state.get("_link_rejects"):
        st.warning(rejects_warning(st.session_state["_link_rejects"]), icon=":material/link_off:")

# The plan's values in the URL, so the address bar is a shareable link to this plan.
st.query_params.from_dict(encode({key: st.session_state.get(key) for key in DEFAULTS}))

router = st.navigation([
    st.Page("app_pages/plan.py", title="Plan", icon=":material/calculate:", default=True),
    st.Page("app_pages/what_fits.py", title="What fits", icon=":material/fit_screen:"),
    st.Page("app_pages/techniques.py", title="Techniques", icon=":material/compare:"),
    st.Page("app_pages/multi_gpu.py", title="Multiple GPUs", icon=":material/lan:"),
    st.Page("app_pages/verify.py", title="Verify", icon=":material/fact_check:"),
    st.Page("app_pages/report.py", title="Report", icon=":material/download:"),
])
router.run()
