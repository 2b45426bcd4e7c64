package capstan

import (
	"testing"

	pb "capstan.dev/sdk-go-example/gen/capstan/v1"
)

func TestInvocationsContinueTheControllersTrace(t *testing.T) {
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	inv, err := newInvocation(&pb.Invocation{
		InvocationId: "i1", HandlerId: "create_fn",
		TraceContext: map[string]string{"traceparent": parent},
	}, KindCreate)
	if err != nil {
		t.Fatal(err)
	}
	if inv.Traceparent != parent || inv.TraceID() != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Fatalf("traceparent %q, trace id %q", inv.Traceparent, inv.TraceID())
	}
	if c := inv.child("sub", &pb.SubhandlerState{}); c.TraceID() != inv.TraceID() {
		t.Fatalf("a sub-handler continues the trace: %q", c.TraceID())
	}
	for _, bad := range []string{"", "00-XYZ-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736"} {
		if id := (&Invocation{Traceparent: bad}).TraceID(); id != "" {
			t.Fatalf("%q gave %q", bad, id)
		}
	}
}
