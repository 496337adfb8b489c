// The fp64 reference of one step of the plain recurrence (docs/math-and-abi.md, "One step of
// the recurrence"), written independently of the code under test. Shared by the kernel tests
// and the cache tests.
#ifndef REPLAYSSM_KERNELS_TESTS_REFERENCE_H_
#define REPLAYSSM_KERNELS_TESTS_REFERENCE_H_

#include "replayssm/kernels.h"

namespace replayssm::kernels::testing {

// Advances state [HV, V, K] by one token and writes o [HV, V]. The token's inputs are fp32
// values (already rounded to the activation dtype): qkv [2*H*K + HV*V], a [HV] or [HV, K],
// b [HV]. a_log [HV], dt_bias [HV] or [HV, K]. round_beta: beta = sigmoid(b) is rounded to the
// act dtype (rssm_layer_params.round_beta). With a 16-bit ring (rssm_ring_storage_dtype of the
// shape) the state takes d and k rounded to it, as the ring stores them; the output uses them
// unrounded (docs/math-and-abi.md, "Precision"). The state itself is never rounded here.
void ReferenceStep(const rssm_layer_shape& shape, const float* a_log, const float* dt_bias,
                   double scale, bool l2norm, bool round_beta, const float* qkv, const float* a,
                   const float* b, double* state, double* o);

}  // namespace replayssm::kernels::testing

#endif  // REPLAYSSM_KERNELS_TESTS_REFERENCE_H_
