// Test helpers for the ZMQ event sockets (the server's --kv-events-*): a blocking receive of one
// message and the 8-byte big-endian sequence numbers the sockets carry. Tests only.
#ifndef REPLAYSSM_TESTS_ZMQ_TESTING_H_
#define REPLAYSSM_TESTS_ZMQ_TESTING_H_

#include <zmq.h>

#include <cstdint>
#include <string>
#include <vector>

namespace replayssm::zmq_testing {

// One message's frames; what arrived of it when the socket's receive timeout passed first
// (none: empty).
inline std::vector<std::string> Frames(void* socket) {
  std::vector<std::string> out;
  for (;;) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, socket, 0) < 0) {
      zmq_msg_close(&m);
      return out;
    }
    out.emplace_back(static_cast<const char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
    const bool more = zmq_msg_more(&m) != 0;
    zmq_msg_close(&m);
    if (!more) return out;
  }
}

// A sequence-number frame's value (-1: the replay's end marker).
inline int64_t Seq(const std::string& bytes) {
  uint64_t v = 0;
  for (unsigned char c : bytes) v = (v << 8) | c;
  return static_cast<int64_t>(v);
}

}  // namespace replayssm::zmq_testing

#endif  // REPLAYSSM_TESTS_ZMQ_TESTING_H_
