"""The whole API against the real server (tiny-gdn, CPU backend), outputs checked against the
numpy reference of the recurrence: info, stats, health, slots, prefill, decode (unary and
stream, through ring folds), prefill and verify on the stream, verify/accept, export/import,
the prefix cache, transfer."""

import unittest

import numpy as np

import replayssm
from replayssm import pb
from support import ServerProcess, ServerTest, rows_of


class InfoTest(ServerTest):
    def test_info_describes_the_model_and_its_layer_parameters(self):
        m = self.model
        self.assertEqual((m.name, m.num_layers, m.gate), ("tiny-gdn", 4, pb.GATE_GDN))
        self.assertEqual((m.num_qk_heads, m.num_v_heads, m.head_k, m.head_v, m.ring_len),
                         (2, 4, 32, 32, 8))
        self.assertEqual((m.state_dtype, m.act_dtype), (replayssm.F32, replayssm.F32))
        self.assertEqual(len(m.layer_params), 4)
        self.assertEqual(len(m.layer_params[0].a_log), 4)
        self.assertEqual(self.info.backend, "cpu")
        self.assertGreater(self.info.capacity_slots, 0)
        self.assertEqual(self.info.track_interval, 16)

    def test_stats_count_live_slots(self):
        a = self.client.allocate().slot
        self.client.allocate()
        self.assertEqual(self.client.stats().slots_live, 2)
        self.client.free(a)
        self.assertEqual(self.client.stats().slots_live, 1)

    def test_health_is_serving_for_the_server_and_the_service(self):
        self.assertEqual(self.client.health(), "SERVING")
        self.assertEqual(self.client.health("replayssm.v1.ReplaySsm"), "SERVING")


class SlotTest(ServerTest):
    def test_a_new_slot_is_empty_and_a_freed_one_is_gone(self):
        alloc = self.client.allocate()
        self.assertNotEqual(alloc.slot, 0)
        self.assertEqual(alloc.matched, 0)
        state = self.client.get_slot(alloc.slot)
        self.assertEqual((state.slot, state.seq_len, state.write_pos), (alloc.slot, 0, 0))
        self.client.free(alloc.slot)
        with self.assertRaises(replayssm.NotFound):
            self.client.get_slot(alloc.slot)

    def test_list_slots_shows_live_slots_only(self):
        kept = self.client.allocate().slot
        freed = self.client.allocate().slot
        self.client.free(freed)
        listed = {l.state.slot: l for l in self.client.list_slots()}
        self.assertIn(kept, listed)
        self.assertNotIn(freed, listed)
        self.assertEqual(listed[kept].state.seq_len, 0)
        self.assertGreaterEqual(listed[kept].idle_seconds, 0.0)


class PrefillDecodeTest(ServerTest):
    def test_prefill_outputs_match_the_reference_and_advance_the_slot(self):
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        got = self.prefill(slot, state, 5)
        self.assertEqual(got.state.seq_len, 5)
        quiet = self.client.prefill(slot, [1, 2], self.layers(2))
        self.assertEqual(quiet.outputs, [])
        self.assertEqual(quiet.state.seq_len, 7)

    def test_unary_decode_matches_the_reference_through_ring_folds(self):
        s1, s2 = self.client.allocate().slot, self.client.allocate().slot
        st1, st2 = self.ref.new_state(), self.ref.new_state()
        self.prefill(s1, st1, 3)
        self.prefill(s2, st2, 2)
        steps = 2 * self.model.ring_len + 3
        for step in range(steps):
            rows, states = ([s1, s2], [st1, st2]) if step % 2 else ([s2, s1], [st2, st1])
            got = self.decode(rows, states)
            self.assertEqual([r.slot for r in got.rows], rows)
            self.assertLess(got.rows[0].write_pos, self.model.ring_len)
        self.assertEqual(self.client.get_slot(s1).seq_len, 3 + steps)
        for l, checkpoint in enumerate(self.client.export_state(s1).checkpoints):
            self.assertClose(checkpoint, st1[l], f"layer {l} state")

    def test_a_padding_row_outputs_zero_and_touches_no_state(self):
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        layers = self.layers(2)
        got = self.client.decode([(0, 0), (slot, 9)], layers)
        for l, x in enumerate(layers):
            want = self.ref.decode_layer([None, state], l, *x)
            self.assertClose(got.outputs[l], want)
            self.assertFalse(np.any(got.outputs[l][0]))
        self.assertEqual([r.slot for r in got.rows], [0, slot])

    def test_stream_forwards_layer_by_layer_match_the_reference(self):
        slots = [self.client.allocate().slot for _ in range(3)]
        states = [self.ref.new_state() for _ in slots]
        v_begin = 2 * self.model.num_qk_heads * self.model.head_k
        with self.client.open_stream() as stream:
            for step in range(self.model.ring_len + 2):
                begun = stream.begin([(s, 40 + step) for s in slots])
                self.assertEqual((begun.batch, begun.replayed), (3, False))
                previous = None
                for l, x in enumerate(self.layers(len(slots))):
                    if previous is not None:  # a model's next layer reads this one's output
                        x.mixed_qkv[:, v_begin:] = previous.reshape(len(slots), -1)
                    out = stream.run_layer(l, *x)
                    self.assertClose(out, self.ref.decode_layer(states, l, *x), f"layer {l}")
                    previous = out
                rows = stream.commit()
                self.assertEqual([r.seq_len for r in rows], [step + 1] * 3)

    def test_stream_forward_helper_runs_a_whole_forward(self):
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        stream = self.client.open_stream()
        self.addCleanup(stream.close)
        for _ in range(3):
            layers = self.layers(1)
            got = stream.forward([(slot, 5)], layers)
            for l, x in enumerate(layers):
                self.assertClose(got.outputs[l], self.ref.decode_layer([state], l, *x))
        self.assertEqual(got.rows[0].seq_len, 3)


class StreamPrefillVerifyTest(ServerTest):
    def test_a_stream_prefill_of_two_prompts_matches_the_reference(self):
        s1, s2 = self.client.allocate().slot, self.client.allocate().slot
        st1, st2 = self.ref.new_state(), self.ref.new_state()
        with self.client.open_stream() as stream:
            begun = stream.begin_prefill([(s1, range(10, 13)), (s2, range(20, 25))])
            self.assertEqual(begun.tokens, 8)
            for l, x in enumerate(self.layers(8)):
                want = np.concatenate([self.ref.run_layer(st1, l, *(y[:3] for y in x)),
                                       self.ref.run_layer(st2, l, *(y[3:] for y in x))])
                self.assertClose(stream.run_layer(l, *x), want, f"layer {l}")
            rows = stream.commit()
        self.assertEqual([(r.slot, r.seq_len, r.write_pos) for r in rows],
                         [(s1, 3, 0), (s2, 5, 0)])
        self.decode([s1, s2], [st1, st2])

    def test_a_stream_verify_matches_the_reference_and_waits_for_accept(self):
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        self.prefill(slot, state, 2)
        layers = self.layers(2)
        with self.client.open_stream() as stream:
            stream.begin_verify([slot], [[7, 8]])
            for l, x in enumerate(layers):
                scratch = [s.copy() for s in state]
                self.assertClose(stream.run_layer(l, *x), self.ref.run_layer(scratch, l, *x))
            [row] = stream.commit()
        self.assertEqual((row.seq_len, row.pending_drafts), (2, 2))
        self.assertEqual(self.client.accept(slot, 1).seq_len, 3)
        for l, x in enumerate(rows_of(layers, 0, 1)):
            self.ref.run_layer(state, l, *x)
        self.decode([slot], [state])


class VerifyTest(ServerTest):
    def test_verify_outputs_match_decoding_the_drafts_and_accept_keeps_the_first_n(self):
        s1, s2 = self.client.allocate().slot, self.client.allocate().slot
        st1, st2 = self.ref.new_state(), self.ref.new_state()
        self.prefill(s1, st1, 4)
        self.prefill(s2, st2, 3)
        t = 3
        layers = self.layers(2 * t)
        outs = self.client.verify([s1, s2], [[11, 12, 13], [21, 22, 23]], layers)
        for l, x in enumerate(layers):
            for row, state in enumerate((st1, st2)):
                scratch = [s.copy() for s in state]
                want = self.ref.run_layer(scratch, l, *(y[row * t:(row + 1) * t] for y in x))
                self.assertClose(outs[l][row * t:(row + 1) * t], want, f"layer {l} row {row}")
        pending = self.client.get_slot(s1)
        self.assertEqual((pending.seq_len, pending.pending_drafts), (4, 3))
        self.assertEqual(self.client.accept(s1, 2).seq_len, 6)
        self.assertEqual(self.client.accept(s2, 0).seq_len, 3)
        for l, x in enumerate(rows_of(layers, 0, 2)):  # row 0's first two drafts now count
            self.ref.run_layer(st1, l, *x)
        self.decode([s1, s2], [st1, st2])


class ImportExportTest(ServerTest):
    def test_export_folds_and_an_import_reproduces_the_state_in_another_slot(self):
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        self.prefill(slot, state, 5)
        self.decode([slot], [state])
        self.decode([slot], [state])
        self.assertGreater(self.client.get_slot(slot).write_pos, 0)
        exported = self.client.export_state(slot)
        self.assertEqual(self.client.get_slot(slot).write_pos, 0)
        self.assertEqual((exported.seq_len, len(exported.tokens)), (7, 7))
        for l, checkpoint in enumerate(exported.checkpoints):
            self.assertEqual(checkpoint.shape, (4, 32, 32))
            self.assertClose(checkpoint, state[l], f"layer {l}")
        # The short convolution's window: the last W-1 inputs, exactly (pre-convolution).
        self.assertEqual(len(exported.conv_windows), self.model.num_layers)
        for l, window in enumerate(exported.conv_windows):
            np.testing.assert_array_equal(window, self.ref.conv_window(state, l))

        copy = self.client.allocate().slot
        imported = self.client.import_state(copy, exported.tokens, exported.checkpoints,
                                           exported.conv_windows)
        self.assertEqual((imported.seq_len, imported.write_pos), (7, 0))
        again = self.client.export_state(copy)
        for mine, theirs in zip(again.checkpoints, exported.checkpoints):
            np.testing.assert_array_equal(mine, theirs)
        layers = self.layers(1)
        a = self.client.decode([(slot, 1)], layers).outputs
        b = self.client.decode([(copy, 1)], layers).outputs
        for l in range(self.model.num_layers):
            np.testing.assert_array_equal(a[l], b[l])


class PrefixTest(ServerTest):
    def test_a_donated_state_is_matched_and_a_new_slot_starts_from_it(self):
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        self.prefill(slot, state, 12, first_token=100)
        tokens = list(range(100, 112))
        self.client.donate(slot)
        with self.assertRaises(replayssm.NotFound):
            self.client.get_slot(slot)
        self.assertEqual(self.client.match_prefix(tokens + [5, 6]), 12)
        self.assertEqual(self.client.match_prefix([1, 2, 3]), 0)
        alloc = self.client.allocate(tokens + [5])
        self.assertEqual(alloc.matched, 12)
        self.assertEqual(self.client.get_slot(alloc.slot).seq_len, 12)
        self.decode([alloc.slot], [state])  # continues from the donated state
        self.assertEqual(self.client.stats().donations, 1)


class CacheWatchTest(ServerTest):
    def test_a_cache_watch_yields_batches_and_ends_in_typed_errors(self):
        watch = self.client.watch_cache()
        self.assertTrue(next(watch).resync)  # a watch from (0, 0) starts with a resync
        watch.cancel()
        with self.assertRaises(replayssm.Cancelled) as caught:
            next(watch)
        self.assertEqual(caught.exception.method, "WatchCache")
        with self.assertRaises(replayssm.DeadlineExceeded):
            for _ in self.client.watch_cache(timeout=0.3):
                pass


class TransferTest(ServerTest):
    def test_a_slot_moves_to_a_peer_by_push_and_back_by_pull(self):
        peer = ServerProcess()
        self.addCleanup(peer.stop)
        other = replayssm.Client(peer.grpc_address, timeout=30)
        self.addCleanup(other.close)
        slot = self.client.allocate().slot
        state = self.ref.new_state()
        self.prefill(slot, state, 5)
        self.decode([slot], [state])
        pushed = self.client.transfer_slot(slot, peer.grpc_address, keep_source=True)
        self.assertEqual(pushed.seq_len, 6)
        self.assertGreater(pushed.bytes, 0)
        mine, theirs = self.client.export_state(slot), other.export_state(pushed.remote_slot)
        for a, b in zip(mine.checkpoints, theirs.checkpoints):
            np.testing.assert_array_equal(a, b)
        pulled = self.client.pull_slot(pushed.remote_slot, peer.grpc_address)
        self.assertEqual(pulled.seq_len, 6)
        with self.assertRaises(replayssm.NotFound):
            other.get_slot(pushed.remote_slot)
        self.decode([pulled.slot], [state])


if __name__ == "__main__":
    unittest.main()
