"""
fastopt C++ core: ONNX wire-format reader/writer and graph IR
"""
from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
import typing
import typing_extensions
__all__: list[str] = ['Bytes', 'FACT_ATTENTION_FUSED', 'FACT_NO_INTERNAL_OPS', 'FACT_VALUE_TYPES', 'FOLD_MAX_BYTES', 'FOLD_MAX_EXPAND_BYTES', 'FUSED_OPS_OPSET', 'Function', 'Graph', 'INTERNAL_DOMAIN', 'KV_PAST_PREFIX', 'KV_PRESENT_PREFIX', 'KvCacheForm', 'Match', 'Model', 'ModelError', 'Node', 'OptionInfo', 'PassInfo', 'PassResult', 'Pattern', 'PatternNode', 'QUANT_BLOCK_SIZE_MAX', 'QUANT_BLOCK_SIZE_MIN', 'QuantRecord', 'ROTARY_MAX_POSITIONS_LIMIT', 'Rewriter', 'Rule', 'ShapeFacts', 'Tensor', 'Value', 'analyze_shapes', 'apply_rules', 'constant_nodes_model', 'cpp_passes', 'dtype_name', 'gptq_dequantize', 'kv_cache_forms', 'load', 'load_bytes', 'load_skeleton', 'make_tensor', 'move_cross_projections', 'native_fold_ops', 'native_fold_unsupported', 'nested_graphs', 'ort_fold_candidates', 'quant_block_size_problem', 'quantization_error', 'run_pass', 'shape_analysis_summary', 'shape_facts', 'weight_column_sums', 'weight_rows', 'write_file']
class ModelError(Exception):
    pass
class Tensor:
    """
    A tensor whose bytes stay where they were read
    """
    def __repr__(self) -> str:
        ...
    def numpy(self) -> typing.Any:
        """
        The tensor as a numpy array (zero copy and read-only when the bytes allow)
        """
    def raw_bytes(self) -> Bytes:
        """
        Element bytes (little-endian): a view for raw/external data, decoded for typed fields
        """
    def strings(self) -> list[bytes]:
        """
        Elements of a STRING tensor
        """
    @property
    def dtype(self) -> int:
        ...
    @property
    def external_location(self) -> tuple[str, int, int] | None:
        """
        (path, offset, length) of external data, or None
        """
    @property
    def is_external(self) -> bool:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def shape(self) -> tuple[int, ...]:
        ...
    @property
    def storage(self) -> str:
        ...
class Value:
    """
    A value (edge) of the graph
    """
    def __eq__(self, arg0: typing.Any) -> bool:
        ...
    def __hash__(self) -> int:
        ...
    def __repr__(self) -> str:
        ...
    def rename(self, arg0: str) -> None:
        ...
    def replace_all_uses_with(self, arg0: Value) -> None:
        """
        Points every use of this value (and graph outputs) at `other`
        """
    def replace_with_constant(self, dtype: typing.SupportsInt | typing.SupportsIndex, shape: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], data: typing_extensions.Buffer) -> Value:
        """
        Puts a constant (ONNX element type, shape, little-endian bytes) in place of this value everywhere: a new initializer, or a Constant node in function bodies and for graph outputs (which keep their name). Removes the producer once none of its outputs is used. Returns the constant's value.
        """
    @property
    def constant(self) -> Tensor | None:
        """
        The value's tensor when it is fixed (an initializer that is not a graph input, or a Constant node's output), else None
        """
    @property
    def dtype(self) -> int:
        ...
    @property
    def graph(self) -> Graph:
        ...
    @property
    def initializer(self) -> Tensor | None:
        ...
    @property
    def is_graph_input(self) -> bool:
        ...
    @property
    def is_graph_output(self) -> bool:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def producer(self) -> Node | None:
        ...
    @property
    def producer_output(self) -> int:
        ...
    @property
    def shape(self) -> tuple[int | str | None, ...] | None:
        ...
    @property
    def uses(self) -> list[tuple[Node, int]]:
        """
        (node, input index) pairs, including nodes inside subgraphs
        """
class Node:
    """
    An operator node
    """
    def __eq__(self, arg0: typing.Any) -> bool:
        ...
    def __hash__(self) -> int:
        ...
    def __repr__(self) -> str:
        ...
    def set_input(self, arg0: typing.SupportsInt | typing.SupportsIndex, arg1: Value | None) -> None:
        ...
    @property
    def alive(self) -> bool:
        ...
    @property
    def attribute_refs(self) -> dict[str, str]:
        """
        Attributes that refer to an attribute of the enclosing function: name -> referenced name
        """
    @property
    def attributes(self) -> dict:
        """
        name -> int, float, bytes, Tensor, Graph, or a list of those
        """
    @property
    def domain(self) -> str:
        ...
    @property
    def graph(self) -> Graph:
        ...
    @property
    def inputs(self) -> list[Value | None]:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def op_type(self) -> str:
        ...
    @property
    def outputs(self) -> list[Value | None]:
        ...
    @property
    def subgraphs(self) -> list[Graph]:
        ...
class Graph:
    """
    A graph or subgraph
    """
    def __repr__(self) -> str:
        ...
    def add_node(self, op_type: str, inputs: collections.abc.Sequence[Value | None], outputs: collections.abc.Sequence[str], domain: str = '', name: str = '', before: Node | None = None) -> Node:
        """
        Creates a node; output names are made unique
        """
    def add_output(self, arg0: Value) -> None:
        ...
    def initializer(self, arg0: str) -> Tensor | None:
        ...
    def remove_node(self, arg0: Node) -> None:
        ...
    def topological_sort(self) -> None:
        ...
    def value(self, arg0: str) -> Value | None:
        """
        The value with this name, looked up in this graph and then enclosing graphs
        """
    @property
    def initializers(self) -> list[Tensor]:
        ...
    @property
    def inputs(self) -> list[Value | None]:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def node_count(self) -> int:
        ...
    @property
    def nodes(self) -> list[Node]:
        ...
    @property
    def outer_references(self) -> list[Value]:
        """
        Values of enclosing graphs used in this graph
        """
    @property
    def outputs(self) -> list[Value | None]:
        ...
    @property
    def owner(self) -> Node | None:
        ...
class Function:
    """
    A model-local function (FunctionProto)
    """
    @property
    def attribute_names(self) -> list[str]:
        ...
    @property
    def domain(self) -> str:
        ...
    @property
    def graph(self) -> Graph:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def overload(self) -> str:
        ...
class Model:
    """
    An ONNX model; weights stay in their files
    """
    def apply_types(self, skeleton_bytes: bytes) -> int:
        """
        Applies the value types of an edited skeleton of this model (e.g. after onnx shape inference): values are matched by name per graph; a type is set where missing and refined where the other is more specific; graph inputs keep theirs. Values whose type changed get value_info entries. Returns how many changed.
        """
    def external_checksums(self) -> list[tuple[str, str, str]]:
        """
        (tensor, data file, checksum) of each external tensor with a 'checksum' key (fastopt.verify_checksums checks them)
        """
    def external_data_files(self) -> list[str]:
        ...
    def graphs(self) -> list[Graph]:
        """
        Every graph: the main graph, function bodies and nested subgraphs
        """
    def node_count(self) -> int:
        """
        The number of nodes over all graphs (the sum of op_counts(), without building it)
        """
    def note_edit(self) -> None:
        """
        Marks the model edited: memoized analyses (the shape facts) recompute
        """
    def num_parameters(self) -> int:
        """
        Elements in all initializers (subgraphs included)
        """
    def op_counts(self) -> dict[str, int]:
        """
        Operator histogram over all graphs: 'Op' for ai.onnx, 'domain::Op' otherwise
        """
    def parameter_bytes(self) -> int:
        """
        Bytes of all initializers (subgraphs included)
        """
    def save(self, path: typing.Any, external_data: typing.Any = None, *, location: str = '', size_threshold: typing.SupportsInt | typing.SupportsIndex = 1024, align: typing.SupportsInt | typing.SupportsIndex = 0, max_file_bytes: typing.SupportsInt | typing.SupportsIndex = 0, side_files: collections.abc.Mapping[str, bytes] = {}, fsync: bool = True, before_commit: typing.Any = None) -> None:
        """
        Writes the model: complete or absent at every instant, never over the loaded model's files.
        
        Files are written unnamed and named at the end, data files before the model file (the old
        model file is removed first, so it never sits beside new data); missing folders are created.
        
        Parameters
        ----------
        path : str or os.PathLike
            The model file to write.
        external_data : None, bool or str, default None
            None: a self-contained file when it fits protobuf's 2 GB limit, external data otherwise;
            True: tensors of at least `size_threshold` bytes always go to `location`; False: never
            (ModelError over 2 GB); a string: True with that location.
        location : str, default '<file name>.data'
            The data file, beside the model.
        size_threshold : int, default 1024
            Smallest tensor (bytes) moved to external data.
        align : int, default 0
            Pad each tensor's offset in the data file to a multiple of it (4096 lets runtimes mmap).
        max_file_bytes : int, default 0
            Above 0, split the data into several files.
        side_files : dict of str to bytes, default {}
            Small files written beside the model and committed with it (genai_config.json).
        fsync : bool, default True
            False writes as cp does: no writeback while writing and no fsync, so the save returns
            before the bytes reach the disk; the files are still complete or absent for every reader
            and if this process dies, but a power loss may leave them partial.
        before_commit : callable, optional
            Called with no arguments once every file is written (and fsynced) but none named: an
            exception from it is raised here and leaves nothing written (optimize's run check, running
            beside the save, refuses its output so).
        
        Raises
        ------
        ModelError
            A path that is the loaded model's own file or one of its external data files (by identity:
            links and symlinks included), a directory, FIFO, socket or device; a save after one of the
            loaded files shrank or changed; a second save to the same output at the same time.
        """
    def self_contained_size(self) -> int:
        """
        Bytes of the model serialized with all data inline
        """
    def serialize(self) -> bytes:
        """
        The model as ModelProto bytes, all data inline (under 2 GB only)
        """
    def skeleton(self, threshold_bytes: typing.SupportsInt | typing.SupportsIndex = 1024) -> bytes:
        """
        The model as ModelProto bytes with every tensor payload of at least threshold_bytes
        replaced by an external-data placeholder (location '*fastopt-skeleton*', offset = an index into
        a table this Model keeps). Small whatever the weights weigh: hand it to tools that edit
        ModelProtos (onnx shape inference, version conversion), then bind the result back with
        fastopt._C.load_skeleton(bytes, model) or apply its types with Model.apply_types.
        """
    def to_onnx(self) -> typing.Any:
        """
        The model as an onnx.ModelProto, all data inline (for models under 2 GB)
        """
    def verify(self) -> None:
        """
        Checks the IR's invariants; raises ModelError naming the first broken one
        """
    def zeros_skeleton(self, threshold_bytes: typing.SupportsInt | typing.SupportsIndex, location: str) -> tuple[bytes, int]:
        """
        The model as ModelProto bytes whose tensor payloads of at least threshold_bytes are
        external data in the file `location` (beside the model file), each at its own page-aligned
        offset, and that file's length: a sparse file of zeros that long lets ONNX Runtime load and run
        the graph without reading or copying the weights (fastopt.verify.run_check).
        """
    @property
    def base_dir(self) -> str:
        ...
    @property
    def doc_string(self) -> str:
        ...
    @property
    def domain(self) -> str:
        ...
    @property
    def functions(self) -> list[Function]:
        ...
    @property
    def graph(self) -> Graph:
        ...
    @property
    def ir_version(self) -> int:
        ...
    @property
    def metadata_props(self) -> dict[str, str]:
        ...
    @property
    def model_version(self) -> int:
        ...
    @property
    def opset_imports(self) -> dict[str, int]:
        ...
    @property
    def path(self) -> str | None:
        ...
    @property
    def producer_name(self) -> str:
        ...
    @property
    def producer_version(self) -> str:
        ...
class Bytes:
    """
    Read-only view of tensor bytes
    """
    def __len__(self) -> int:
        ...
class KvCacheForm:
    """
    A KV-cache form: the cache's names, dims and how P is fed (passes/kv_cache/cache_form.h)
    """
    @property
    def genai_past_key(self) -> str:
        """
        genai_config.json's key for past_key ("": genai has none)
        """
    @property
    def genai_past_value(self) -> str:
        ...
    @property
    def genai_present_key(self) -> str:
        ...
    @property
    def genai_present_value(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def past_dim(self) -> str:
        """
        the past input's axis 2 (dim_param)
        """
    @property
    def past_key(self) -> str:
        """
        name pattern, %d the layer
        """
    @property
    def past_length(self) -> str:
        """
        where P comes from: attention_mask's width, the past's rows, the input past_sequence_length, or none (encoder: a cross cache)
        """
    @property
    def past_value(self) -> str:
        ...
    @property
    def present_dim(self) -> str:
        """
        the present output's axis 2
        """
    @property
    def present_key(self) -> str:
        ...
    @property
    def present_value(self) -> str:
        ...
    @property
    def section(self) -> str:
        """
        between the layer and .key|.value
        """
    @property
    def shares_buffer(self) -> bool:
        """
        the present is the past's buffer (search.past_present_share_buffer)
        """
class OptionInfo:
    """
    An option a C++ pass reads, declared with the pass
    """
    @property
    def choices(self) -> list[tuple[int, str]]:
        ...
    @property
    def default(self) -> int | None:
        ...
    @property
    def help(self) -> str:
        ...
    @property
    def internal(self) -> bool:
        ...
    @property
    def kind(self) -> str:
        ...
    @property
    def maximum(self) -> int | None:
        ...
    @property
    def minimum(self) -> int | None:
        ...
    @property
    def name(self) -> str:
        ...
class PassInfo:
    """
    A pass implemented in C++
    """
    @property
    def description(self) -> str:
        ...
    @property
    def ensures_facts(self) -> list[str]:
        """
        facts the pass establishes
        """
    @property
    def idempotent(self) -> bool:
        ...
    @property
    def max_opset(self) -> int:
        ...
    @property
    def min_opset(self) -> int:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def options(self) -> list[OptionInfo]:
        """
        the options it reads
        """
    @property
    def requires_facts(self) -> list[str]:
        """
        facts an earlier pass of the list must establish (pass contracts)
        """
    @property
    def rule_names(self) -> list[str]:
        """
        the rule names --explain takes for this pass (beside the pass's own name)
        """
    @property
    def runs_before(self) -> list[str]:
        """
        passes it runs before when both are in the list
        """
    @property
    def tags(self) -> list[str]:
        ...
class QuantRecord:
    """
    What a quantization pass did to one weight
    """
    @property
    def bytes_after(self) -> int:
        ...
    @property
    def bytes_before(self) -> int:
        ...
    @property
    def dtype_after(self) -> str:
        ...
    @property
    def dtype_before(self) -> str:
        ...
    @property
    def max_rel_error(self) -> float:
        ...
    @property
    def mean_rel_error(self) -> float:
        ...
    @property
    def node(self) -> str:
        ...
    @property
    def op(self) -> str:
        ...
    @property
    def quantized(self) -> bool:
        ...
    @property
    def reason(self) -> str:
        ...
    @property
    def rel_mse(self) -> float:
        """
        sum imp[k] (w - w')^2 / sum imp[k] w^2 (imp = 1 without an importance file)
        """
    @property
    def weight(self) -> str:
        ...
class PassResult:
    """
    What one run of a C++ pass did
    """
    @property
    def counters(self) -> dict[str, int]:
        ...
    @property
    def explain_lines(self) -> list[str]:
        ...
    @property
    def quant_records(self) -> list[QuantRecord]:
        ...
class Pattern:
    """
    A declarative pattern, matched in C++
    """
    def __init__(self, name: str) -> None:
        ...
    def alt(self, name: str, alternatives: collections.abc.Sequence[PatternNode]) -> PatternNode:
        ...
    def constant(self, name: str) -> PatternNode:
        """
        Any constant (initializer or Constant output)
        """
    def op(self, op_type: typing.Any, inputs: collections.abc.Sequence[PatternNode], domain: str = '', name: str = '') -> PatternNode:
        """
        An op (or any of a list of op types) producing the value
        """
    def optional(self, op: PatternNode) -> PatternNode:
        """
        Matches the op, or skips it to its first input
        """
    def root(self, arg0: PatternNode) -> None:
        ...
    def scalar(self, name: str, value: typing.SupportsFloat | typing.SupportsIndex, tolerance: typing.SupportsFloat | typing.SupportsIndex = 1e-06) -> PatternNode:
        """
        A constant whose elements are all within tolerance of value
        """
    def var(self, name: str) -> PatternNode:
        """
        Anything; the same name twice must be the same value
        """
    @property
    def benefit(self) -> int:
        ...
    @property
    def name(self) -> str:
        ...
class PatternNode:
    """
    One node of a pattern (an op, a var, ...)
    """
    def attr(self, name: str, value: typing.Any) -> PatternNode:
        """
        Requires an attribute value (None: must be absent)
        """
    def commutative(self) -> PatternNode:
        ...
    def dim(self, axis: typing.SupportsInt | typing.SupportsIndex, symbol: str) -> PatternNode:
        """
        Dim `axis` must be known and equal to every other dim bound to `symbol` in the match
        """
    def dtype_in(self, arg0: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> PatternNode:
        ...
    def extra_inputs(self) -> PatternNode:
        ...
    def output(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> PatternNode:
        ...
    def rank(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> PatternNode:
        ...
    def shared(self) -> PatternNode:
        ...
    @property
    def name(self) -> str:
        ...
class Match:
    """
    A complete match (valid during the rewrite call)
    """
    def __getitem__(self, arg0: str) -> Value | None:
        """
        The value bound to a pattern node by name
        """
    def node(self, arg0: str) -> Node | None:
        """
        The graph node matched by a pattern op node (None for a skipped optional)
        """
    def scalar(self, arg0: str) -> float | None:
        """
        The value of a single-element constant bound to `name`, or None
        """
    @property
    def root(self) -> Node:
        ...
class Rewriter:
    """
    Builds replacement nodes (valid during the rewrite call)
    """
    def fail(self, arg0: str) -> None:
        """
        Declines the rewrite; `return rw.fail('why')`
        """
    def initializer(self, name: str, array: typing.Any) -> Value:
        """
        Adds an initializer holding a copy of `array`
        """
    def op(self, op_type: str, inputs: collections.abc.Sequence[Value | None], attributes: dict = {}, num_outputs: typing.SupportsInt | typing.SupportsIndex = 1, domain: str = '') -> list[Value | None]:
        """
        Adds a node before the matched root; returns its outputs
        """
class Rule:
    """
    A pattern and its rewrite
    """
    def __init__(self, name: str, pattern: Pattern, rewrite: typing.Any = None, replace: typing.Any = None) -> None:
        """
        A rule: `pattern` plus either `rewrite(match, rewriter) -> list[Value | None] | None`
        (Python, called only on complete matches) or `replace=(op_type, [pattern names], {attributes},
        domain)` (runs entirely in C++; an attribute value "$name" takes the scalar constant bound to
        `name`).
        """
    @property
    def name(self) -> str:
        ...
class ShapeFacts:
    """
    The C++ shape analysis of a model's main graph, memoized until an edit
    """
    def __init__(self, model: Model) -> None:
        ...
    def facts(self, name: str) -> typing.Any:
        """
        (dtype, dims, shape value) of the named value (see shape_facts), or None
        """
    def same_dim(self, a: str, axis_a: typing.SupportsInt | typing.SupportsIndex, b: str, axis_b: typing.SupportsInt | typing.SupportsIndex) -> bool:
        """
        Dim axis_a of value a and axis_b of value b are proven equal (the same expression, or equated by a declared type)
        """
    @property
    def computations(self) -> int:
        """
        How many times the facts were computed
        """
def analyze_shapes(model: Model, apply: bool = True) -> tuple[int, dict[str, int]]:
    """
    Runs the C++ shape analysis on the main graph (If/Loop/Scan bodies included); with
    `apply`, writes what it proves into the value types (refining, never losing, what they say;
    changed values get value_info).
    Returns (values whose type changed, {op: count} of nodes it has no rule for).
    """
def apply_rules(model: Model, rules: collections.abc.Sequence[Rule], max_iterations: typing.SupportsInt | typing.SupportsIndex = 10, explain_rule: str = '') -> tuple[int, dict[str, int], list[str]]:
    """
    Applies rules to a fixed point; returns (rewrites, per-rule counts, explanation lines)
    """
def constant_nodes_model(nodes: collections.abc.Sequence[Node], outputs: collections.abc.Sequence[Value] | None = None) -> bytes:
    """
    A serialized model computing `nodes` (one graph, topological order, inputs constant or computed by earlier nodes of the list); its graph outputs are `outputs` (default: every output of the nodes)
    """
def cpp_passes() -> list[PassInfo]:
    """
    The passes implemented in C++, in registration order
    """
def dtype_name(arg0: typing.SupportsInt | typing.SupportsIndex) -> str:
    ...
def gptq_dequantize(weight: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], factor: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], bits: typing.SupportsInt | typing.SupportsIndex = 4, block_size: typing.SupportsInt | typing.SupportsIndex = 32, symmetric: bool = True, params: str = 'search', importance: typing.Any = None, order: typing.Any = None) -> numpy.typing.NDArray[numpy.float32]:
    """
    GPTQ-rounded float weight [K, N] (quantize_weights' quant_method gptq, float32 scales), dequantized: `factor` is the upper Cholesky factor of H^-1 [K, K]; `params` chooses each block's scale and zero point by round to nearest or by the search. `order` (int64 [K]): act order, rows coded in that order with `factor` the permuted H's, each block's parameters chosen before any row is coded.
    """
def kv_cache_forms() -> dict[str, KvCacheForm]:
    """
    The KV-cache forms add_kv_cache writes, by name
    """
def load(path: typing.Any) -> Model:
    """
    Reads an ONNX model file (memory-mapped; weights are not copied)
    """
def load_bytes(data: bytes, base_dir: str = '') -> Model:
    """
    Reads a serialized ModelProto held in memory
    """
def load_skeleton(data: bytes, original: Model) -> Model:
    """
    Reads a skeleton of `original` (Model.skeleton bytes, possibly edited by onnx tools): placeholders take the original's tensor bytes as views (no copy); the new Model keeps the original's buffers alive
    """
def make_tensor(dtype: typing.SupportsInt | typing.SupportsIndex, dims: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], data: bytes) -> Tensor:
    """
    A new tensor owning a copy of `data`
    """
def move_cross_projections(encoder: Model, hidden: str, decoder: Model) -> int:
    """
    Moves the cross cache's projections from a decoder that add_kv_cache gave cross_attention_cache 2 into the encoder, which reads its output `hidden` for encoder_hidden_states and gives present.<i>.encoder.key|value (weights shared, not copied); ModelError with the reason, and neither model changed, when it cannot. Returns the number of outputs moved
    """
def native_fold_ops() -> list[str]:
    """
    Op types fold_constants evaluates natively (others go to fold_constants_ort)
    """
def native_fold_unsupported(node: Node, max_bytes: typing.SupportsInt | typing.SupportsIndex, max_expand_bytes: typing.SupportsInt | typing.SupportsIndex) -> bool:
    """
    True when fold_constants declines this node (inputs constant, outputs within the limits) only for lack of a native implementation for its types: ONNX Runtime may fold it
    """
def nested_graphs(model: Model) -> list[Graph]:
    """
    The main graph and the graphs nested in its nodes (If/Loop/Scan bodies), depth first in node order; function bodies not included
    """
def ort_fold_candidates(graph: Graph, max_bytes: typing.SupportsInt | typing.SupportsIndex, max_expand_bytes: typing.SupportsInt | typing.SupportsIndex, skip: collections.abc.Set[str], safe_division: collections.abc.Callable[[Node], bool]) -> tuple[list[Node], dict[Value, int]]:
    """
    The nodes of `graph` fold_constants_ort evaluates through ONNX Runtime, in graph order, and for each of their outputs the bytes of the constants it is computed from (see passes/fold/fold_constants.h); `safe_division(node)` decides Div, Mod and Pow
    """
def quant_block_size_problem(block_size: typing.SupportsInt | typing.SupportsIndex) -> str:
    """
    Why a quantization block size is not one MatMulNBits runs (the message every entry point shows), or ""
    """
def quantization_error(weight: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], bits: typing.SupportsInt | typing.SupportsIndex = 4, block_size: typing.SupportsInt | typing.SupportsIndex = 32, symmetric: bool = True, method: str = 'search', importance: typing.Any = None) -> dict:
    """
    What quantize_weights would lose on a float weight [K, N] (MatMul's B; float16 is read as float32) without writing anything: {'rel_mse': sum imp[k] (w - w')^2 / sum imp[k] w^2, 'max_rel_error', 'mean_rel_error', 'sq_err'}. `importance`: float32 [K] weights per input channel (None: uniform). Scales as float32 weights store them.
    """
def run_pass(model: Model, name: str, target: str = 'ort', max_iterations: typing.SupportsInt | typing.SupportsIndex = 10, explain_rule: str = '', options: collections.abc.Mapping[str, typing.SupportsInt | typing.SupportsIndex] = {}, text_options: collections.abc.Mapping[str, str] = {}, progress: typing.Any = None) -> tuple[int, PassResult]:
    """
    Runs a C++ pass; returns (rewrites, result). `progress(done, total, what)` is called during long passes (quantization)
    """
def shape_analysis_summary(model: Model) -> tuple[int, int]:
    """
    (nodes the C++ shape analysis gave facts to, If/Loop/Scan bodies it analysed) for the
    model's shared analysis (the one analyze_shapes runs; memoized until an edit).
    """
def shape_facts(model: Model, subgraphs: bool = False) -> dict:
    """
    {value name: (dtype, dims, shape value)} for the main graph (with `subgraphs`, the
    values of If/Loop/Scan bodies too; names are unique across them): dims and elements are
    ints, or strings spelling expressions of symbols ('?N' names a fresh symbol: unknown, but equal
    wherever it appears); None when the rank / the elements are unknown.
    """
def weight_column_sums(weight: Tensor, transposed: bool = False, importance: typing.Any = None, row_stride: typing.SupportsInt | typing.SupportsIndex = 1, row_max: typing.Any = None) -> numpy.typing.NDArray[numpy.float64]:
    """
    Per column n of a float initializer read as MatMul's B [K, N] (transposed: stored [N, K]): sum_k importance[k] W[k, n]^2, float64 [N] (row_stride > 1: from every row_stride-th row, times row_stride). Read from the model's mapping in row chunks whose pages are released once read, as quantize_weights reads. row_max, a writable float64 [K] array, gets each row's largest |W[k, n]| from the same read (0 for rows a stride skips).
    """
def weight_rows(weight: Tensor, transposed: bool, start: typing.SupportsInt | typing.SupportsIndex, rows: typing.SupportsInt | typing.SupportsIndex, columns: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = []) -> numpy.typing.NDArray[numpy.float32]:
    """
    Rows [start, start + rows) and `columns` (all when empty) of a float initializer read as MatMul's B [K, N] (transposed: stored [N, K]) as float32 [rows, len(columns)], read like weight_column_sums (pages released).
    """
def write_file(path: typing.Any, data: bytes) -> None:
    """
    Writes a small output file (e.g. genai_config.json) as Model.save writes a model file
    """
FACT_ATTENTION_FUSED: str = 'attention fused'
FACT_NO_INTERNAL_OPS: str = 'no internal ops'
FACT_VALUE_TYPES: str = 'value types'
FOLD_MAX_BYTES: int = 1048576
FOLD_MAX_EXPAND_BYTES: int = 65536
FUSED_OPS_OPSET: int = 23
INTERNAL_DOMAIN: str = 'ai.fastopt.internal'
KV_PAST_PREFIX: str = 'past_key_values.'
KV_PRESENT_PREFIX: str = 'present.'
QUANT_BLOCK_SIZE_MAX: int = 256
QUANT_BLOCK_SIZE_MIN: int = 16
ROTARY_MAX_POSITIONS_LIMIT: int = 1048576
