package capstan

import "testing"

func TestOnlyTakenIdsAreRetried(t *testing.T) {
	for message, want := range map[string]bool{
		"NO_HANDLERS_ACCEPTED: no handler registration was accepted (a: [HANDLER_ID_TAKEN] held; b: [HANDLER_ID_TAKEN] held)": true,
		"NO_HANDLERS_ACCEPTED: no handler registration was accepted (a: [HANDLER_ID_TAKEN] held; b: [BAD_FILTER] x)":          false,
		"NO_HANDLERS_ACCEPTED: no handler registration was accepted (a: [HANDLER_ID_TAKEN,BAD_FILTER] x)":                     false,
		"NO_HANDLERS_ACCEPTED: no handler registration was accepted":                                                          false,
	} {
		if got := onlyTaken(message); got != want {
			t.Errorf("onlyTaken(%q) = %v, want %v", message, got, want)
		}
	}
}
