// rssm_capture_begin / end and rssm_graph_*: recorded sequences, as CUDA graphs (stream
// capture). The doorbell operations a recording holds are the driver's batch memory-operation
// nodes (rssm_stream_wait_value32, the writes) and the kernel nodes of
// rssm_stream_wait_value32_or, noted as they were queued; a launch with another doorbell value
// or ticket rewrites them in the instantiated graph (cuGraphExecBatchMemOpNodeSetParams,
// cudaGraphExecKernelNodeSetParams) before cudaGraphLaunch. CPU: unsupported.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "calls.h"

struct rssm_graph {
#ifdef REPLAYSSM_WITH_CUDA
  // One batch memory-operation node (a doorbell wait or write), its operations as recorded.
  struct MemOp {
    CUgraphNode node = nullptr;
    std::vector<CUstreamBatchMemOpParams> ops;
    CUDA_BATCH_MEM_OP_NODE_PARAMS params{};
  };
  // One rssm_stream_wait_value32_or kernel node, its arguments as last set.
  struct Wait {
    cudaGraphNode_t node = nullptr;
    replayssm::kernels::cuda::WaitArgs args{};
  };
  cudaGraph_t graph = nullptr;  // kept: the memop nodes are named by its nodes
  cudaGraphExec_t exec = nullptr;
  std::vector<MemOp> memops;
  std::vector<Wait> waits;
  int64_t doorbells = 0;
  bool value_set = false;  // the memops carry `value` (else the values they were recorded with)
  uint32_t value = 0;
#endif
};

namespace replayssm::kernels {
namespace {

// RSSM_OK for a CUDA launch; UNSUPPORTED (CPU) or INVALID_ARGUMENT with the message set.
rssm_status CheckCudaLaunch(const char* fn, const rssm_launch* launch) {
  if (launch == nullptr) return Invalid(fn, "launch: expected a pointer, got NULL");
  if (launch->backend == RSSM_BACKEND_CPU) {
    SetLastError(std::string(fn) +
                 ": recorded sequences need the CUDA backend (CPU calls run at once: run them "
                 "directly)");
    return RSSM_ERR_UNSUPPORTED;
  }
  if (launch->backend != RSSM_BACKEND_CUDA) {
    return Invalid(
        fn, "launch.backend: expected 0 (CPU) or 1 (CUDA), got " + std::to_string(launch->backend));
  }
#ifdef REPLAYSSM_WITH_CUDA
  return RSSM_OK;
#else
  return NoCuda(fn);
#endif
}

#ifdef REPLAYSSM_WITH_CUDA
using NodeTypeFn = CUresult (*)(CUgraphNode, CUgraphNodeType*);
using MemOpGetFn = CUresult (*)(CUgraphNode, CUDA_BATCH_MEM_OP_NODE_PARAMS*);
using MemOpExecSetFn = CUresult (*)(CUgraphExec, CUgraphNode, const CUDA_BATCH_MEM_OP_NODE_PARAMS*);

// The driver's graph calls the runtime has no form of, looked up once (null when missing).
struct GraphCalls {
  NodeTypeFn node_type = nullptr;
  MemOpGetFn memop_get = nullptr;
  MemOpExecSetFn memop_exec_set = nullptr;
};
const GraphCalls& Calls() {
  static const GraphCalls calls{LookupDriver<NodeTypeFn>("cuGraphNodeGetType"),
                                LookupDriver<MemOpGetFn>("cuGraphBatchMemOpNodeGetParams"),
                                LookupDriver<MemOpExecSetFn>("cuGraphExecBatchMemOpNodeSetParams")};
  return calls;
}

bool IsDoorbell(const CUstreamBatchMemOpParams& op) {
  return op.operation == CU_STREAM_MEM_OP_WAIT_VALUE_32 ||
         op.operation == CU_STREAM_MEM_OP_WRITE_VALUE_32;
}

// Finds the recording's doorbell operations (its batch memory-operation nodes).
rssm_status CollectMemOps(rssm_graph& g, const char* fn) {
  const GraphCalls& calls = Calls();
  if (calls.node_type == nullptr || calls.memop_get == nullptr || calls.memop_exec_set == nullptr) {
    SetLastError(std::string(fn) + ": the driver has no batch memory-operation node calls");
    return RSSM_ERR_UNSUPPORTED;
  }
  size_t n = 0;
  if (const rssm_status st = CudaCheck(cudaGraphGetNodes(g.graph, nullptr, &n), fn);
      st != RSSM_OK) {
    return st;
  }
  std::vector<cudaGraphNode_t> nodes(n);
  if (const rssm_status st = CudaCheck(cudaGraphGetNodes(g.graph, nodes.data(), &n), fn);
      st != RSSM_OK) {
    return st;
  }
  for (cudaGraphNode_t node : nodes) {
    CUgraphNodeType type{};
    if (const rssm_status st = DriverCheck(calls.node_type(node, &type), fn); st != RSSM_OK) {
      return st;
    }
    if (type != CU_GRAPH_NODE_TYPE_BATCH_MEM_OP) continue;
    CUDA_BATCH_MEM_OP_NODE_PARAMS p{};
    if (const rssm_status st = DriverCheck(calls.memop_get(node, &p), fn); st != RSSM_OK) return st;
    rssm_graph::MemOp m;
    m.node = node;
    m.ops.assign(p.paramArray, p.paramArray + p.count);
    m.params = p;
    for (const CUstreamBatchMemOpParams& op : m.ops) g.doorbells += IsDoorbell(op) ? 1 : 0;
    g.memops.push_back(std::move(m));
  }
  for (rssm_graph::MemOp& m : g.memops) m.params.paramArray = m.ops.data();  // after the moves
  return RSSM_OK;
}

// Gives every doorbell operation of the recording `value`.
rssm_status SetDoorbells(rssm_graph& g, uint32_t value, const char* fn) {
  for (rssm_graph::MemOp& m : g.memops) {
    for (CUstreamBatchMemOpParams& op : m.ops) {
      if (op.operation == CU_STREAM_MEM_OP_WAIT_VALUE_32) op.waitValue.value = value;
      if (op.operation == CU_STREAM_MEM_OP_WRITE_VALUE_32) op.writeValue.value = value;
    }
    if (const rssm_status st = DriverCheck(Calls().memop_exec_set(g.exec, m.node, &m.params), fn);
        st != RSSM_OK) {
      return st;
    }
  }
  g.value_set = true;
  g.value = value;
  return RSSM_OK;
}

// The release waits queued while a stream records, by the recording's id: an entry from
// rssm_capture_begin to rssm_capture_end (capture is thread-local: both run on the recording
// thread). While it is empty NoteRecordedWait asks the runtime nothing (a forward run call by
// call queues one release wait per layer).
thread_local std::map<unsigned long long, std::vector<rssm_graph::Wait>> recorded_waits;

// The id of the recording `stream` is making, 0 when none.
unsigned long long RecordingId(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  if (cudaStreamGetCaptureInfo(stream, &status, &id) != cudaSuccess ||
      status != cudaStreamCaptureStatusActive) {
    cudaGetLastError();
    return 0;
  }
  return id;
}

// Gives every release wait of the recording `value` and `ticket`.
rssm_status SetWaits(rssm_graph& g, uint32_t value, uint32_t ticket) {
  for (rssm_graph::Wait& w : g.waits) {
    if (w.args.value == value && w.args.ticket == ticket) continue;
    w.args.value = value;
    w.args.ticket = ticket;
    if (const rssm_status st = cuda::SetWaitNode(g.exec, w.node, w.args); st != RSSM_OK) return st;
  }
  return RSSM_OK;
}

void Free(rssm_graph* g) {
  if (g->exec != nullptr) cudaGraphExecDestroy(g->exec);
  if (g->graph != nullptr) cudaGraphDestroy(g->graph);
  delete g;
}
#endif

}  // namespace

#ifdef REPLAYSSM_WITH_CUDA
rssm_status NoteRecordedWait(cudaStream_t stream, const cuda::WaitArgs& args, const char* fn) {
  if (recorded_waits.empty()) return RSSM_OK;
  const unsigned long long id = RecordingId(stream);
  if (id == 0) return RSSM_OK;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* deps = nullptr;
  size_t count = 0;
  if (const rssm_status st = CudaCheck(
          cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, nullptr, &count), fn);
      st != RSSM_OK) {
    return st;
  }
  if (count != 1) {  // the kernel just queued is the one node the next depends on
    SetLastError(std::string(fn) + ": the recording's last node is not the wait just queued");
    return RSSM_ERR_DEVICE;
  }
  recorded_waits[id].push_back(rssm_graph::Wait{deps[0], args});
  return RSSM_OK;
}
#endif

}  // namespace replayssm::kernels

using namespace replayssm::kernels;  // NOLINT: the C ABI below is a thin shell

extern "C" {

rssm_status rssm_capture_begin(const rssm_launch* launch) {
  const char* fn = "rssm_capture_begin";
  if (const rssm_status st = CheckCudaLaunch(fn, launch); st != RSSM_OK) return st;
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, fn); st != RSSM_OK) return st;
  const rssm_status st = CudaCheck(cudaStreamBeginCapture(static_cast<cudaStream_t>(launch->stream),
                                                          cudaStreamCaptureModeThreadLocal),
                                   fn);
  if (st == RSSM_OK) {
    const unsigned long long id = RecordingId(static_cast<cudaStream_t>(launch->stream));
    if (id != 0) recorded_waits.try_emplace(id);  // NoteRecordedWait looks from now on
  }
  return st;
#else
  return RSSM_ERR_UNSUPPORTED;
#endif
}

rssm_status rssm_capture_end(const rssm_launch* launch, int32_t keep, rssm_graph** out) {
  const char* fn = "rssm_capture_end";
  if (out == nullptr) return Invalid(fn, "out: expected a pointer, got NULL");
  *out = nullptr;
  if (keep != 0 && keep != 1) {
    return Invalid(fn, "keep: expected 0 or 1, got " + std::to_string(keep));
  }
  if (const rssm_status st = CheckCudaLaunch(fn, launch); st != RSSM_OK) return st;
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, fn); st != RSSM_OK) return st;
  std::vector<rssm_graph::Wait> waits;
  if (const unsigned long long id = RecordingId(static_cast<cudaStream_t>(launch->stream));
      id != 0) {
    if (auto it = recorded_waits.find(id); it != recorded_waits.end()) {
      waits = std::move(it->second);
      recorded_waits.erase(it);
    }
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(static_cast<cudaStream_t>(launch->stream), &graph);
  cudaGetLastError();  // a call that spoiled the recording must not fail the next launch's check
  if (keep == 0) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    return RSSM_OK;
  }
  if (const rssm_status st = CudaCheck(ended, fn); st != RSSM_OK) return st;
  auto* g = new rssm_graph;
  g->graph = graph;
  g->waits = std::move(waits);
  g->doorbells = static_cast<int64_t>(g->waits.size());
  rssm_status st = CudaCheck(cudaGraphInstantiate(&g->exec, graph, 0), fn);
  if (st == RSSM_OK) st = CollectMemOps(*g, fn);
  if (st != RSSM_OK) {
    Free(g);
    return st;
  }
  *out = g;
  return RSSM_OK;
#else
  return RSSM_ERR_UNSUPPORTED;
#endif
}

int64_t rssm_graph_doorbells(const rssm_graph* graph) {
#ifdef REPLAYSSM_WITH_CUDA
  return graph == nullptr ? 0 : graph->doorbells;
#else
  (void)graph;
  return 0;
#endif
}

rssm_status rssm_graph_launch(const rssm_launch* launch, rssm_graph* graph, uint32_t doorbell_value,
                              uint32_t release_ticket) {
  const char* fn = "rssm_graph_launch";
  if (graph == nullptr) return Invalid(fn, "graph: expected a recording, got NULL");
  if (const rssm_status st = CheckCudaLaunch(fn, launch); st != RSSM_OK) return st;
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, fn); st != RSSM_OK) return st;
  if (graph->doorbells > 0 && (!graph->value_set || graph->value != doorbell_value)) {
    if (const rssm_status st = SetDoorbells(*graph, doorbell_value, fn); st != RSSM_OK) return st;
  }
  if (const rssm_status st = SetWaits(*graph, doorbell_value, release_ticket); st != RSSM_OK) {
    return st;
  }
  return CudaCheck(cudaGraphLaunch(graph->exec, static_cast<cudaStream_t>(launch->stream)), fn);
#else
  (void)doorbell_value;
  (void)release_ticket;
  return RSSM_ERR_UNSUPPORTED;
#endif
}

rssm_status rssm_graph_destroy(rssm_graph* graph) {
  if (graph == nullptr) return RSSM_OK;
#ifdef REPLAYSSM_WITH_CUDA
  Free(graph);
#endif
  return RSSM_OK;
}

}  // extern "C"
